"""Tokenizer, chat template and incremental detokenizer.

Imports only the stdlib, `tokenizers` and `jinja2` at module level: the edge
proxy renders and tokenizes conversations with this module and must never pull
in torch. GGUF and Hugging Face file reading is imported inside the
constructors that need it.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from replica.fim import FimTokens

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4


class ChatTemplateError(ValueError):
    """The conversation does not fit the model's chat template (or there is none)."""


def _raise_exception(message: str):
    raise ChatTemplateError(message)


def _tojson(value, indent=None):
    # Hugging Face's variant: no HTML escaping, non-ASCII kept as is.
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """The environment Hugging Face chat templates are written for."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    env.filters["tojson"] = _tojson
    return env.from_string(source)


def _gguf_pre_tokenizer(pre: str, path: str):
    """llama.cpp's pre-tokenizer names -> `tokenizers` pipelines."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # GPT-2 regex, no prefix space
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "gpt-2":
        return byte_level
    raise ValueError(f"{path}: GGUF pre-tokenizer {pre!r} is not supported (smollm, gpt-2); "
                     "pass the model's Hugging Face folder (with tokenizer.json) instead")


class Tokenizer:
    """A `tokenizers` tokenizer plus what serving needs: EOS ids and the chat template."""

    def __init__(self, backend: BackendTokenizer, *, eos_token_ids, bos_token_id: int | None = None,
                 chat_template: str | None = None, bos_token: str | None = None, eos_token: str | None = None):
        self.backend = backend
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self._template = compile_chat_template(chat_template) if chat_template else None
        self._pieces: dict[int, tuple[str, bytes]] = {}

    @functools.cached_property
    def fim(self) -> FimTokens | None:
        """Fill-in-the-middle tokens, if the vocabulary has a convention's (replica.fim)."""
        return FimTokens.detect(self.token_to_id)

    def piece(self, token_id: int) -> tuple[str, bytes]:
        """One token as OpenAI's logprobs name it: its text and its exact bytes (byte-level
        BPE tokens and <0xNN> byte tokens may hold part of a UTF-8 character)."""
        p = self._pieces.get(token_id)
        if p is None:
            tok = self.backend.id_to_token(token_id) or ""
            text = self.backend.decode([token_id], skip_special_tokens=False)
            raw = text.encode()
            byte_decoder = _byte_decoder() if type(self.backend.decoder).__name__ == "ByteLevel" else None
            if byte_decoder is not None and tok and all(ch in byte_decoder for ch in tok):
                raw = bytes(byte_decoder[ch] for ch in tok)
            elif len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                raw = bytes([int(tok[3:5], 16)])
            p = self._pieces[token_id] = (text, raw)
        return p

    @functools.cached_property
    def fingerprint(self) -> str:
        """Digest of everything that maps text to ids (vocabulary, merges, special tokens,
        pre-tokenizer, chat template, BOS/EOS): the proxy tokenizes for the replicas and
        routes only to replicas whose Hello carries the same one."""
        h = hashlib.sha256(self.backend.to_str().encode())
        h.update(json.dumps([self.chat_template, self.eos_token_ids, self.bos_token_id]).encode())
        return h.hexdigest()[:16]

    # -- text <-> ids -------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Special tokens written in `text` (e.g. <|im_start|>) become their single ids.
        `add_special_tokens` applies the tokenizer's own post-processor (Llama's BOS);
        the default model adds nothing. `encode_batch_fast` releases the GIL while it
        works (plain `encode` holds it: a 1 MB prompt would stall every other thread
        for a second) and skips the offsets nobody here reads."""
        return self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # -- chat -------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render with the model's own template; extra kwargs (tools=...) reach the template."""
        if self._template is None:
            raise ChatTemplateError("this model has no chat template: send a plain prompt (/v1/completions)")
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except ChatTemplateError:
            raise
        except (jinja2.TemplateError, TypeError) as e:  # TypeError: e.g. "\n" + None for a null content
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        # The template writes BOS itself where the model wants one.
        text = self.apply_chat_template(messages, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)

    # -- constructors -------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Byte-level BPE from tokenizer.ggml.tokens/merges; control tokens become special."""
        from replica.gguf_file import GGUFFile

        gf = GGUFFile(path)
        if gf.require("tokenizer.ggml.model") != "gpt2":
            raise ValueError(f"{path}: GGUF tokenizer model {gf.get('tokenizer.ggml.model')!r} is not supported "
                             "(only byte-level BPE, 'gpt2'); pass the Hugging Face folder instead")
        tokens: list[str] = gf.require("tokenizer.ggml.tokens")
        vocab = {tok: i for i, tok in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError(f"{path}: duplicate strings in tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in gf.require("tokenizer.ggml.merges")]
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=merges))
        backend.pre_tokenizer = _gguf_pre_tokenizer(gf.get("tokenizer.ggml.pre", "gpt-2"), str(path))
        backend.decoder = decoders.ByteLevel()
        types = gf.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        # Same ids as in the vocabulary; never split, never normalized. Control tokens are
        # special (skipped when decoding); user-defined ones are matched whole but kept.
        backend.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                            for i, t in enumerate(types) if t == _USER_DEFINED])
        backend.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                    for i, t in enumerate(types) if t == _CONTROL])
        bos = gf.get("tokenizer.ggml.bos_token_id")
        eos_ids = gf.eos_token_ids()
        if gf.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)])
        return cls(backend, eos_token_ids=eos_ids, bos_token_id=bos, chat_template=gf.get("tokenizer.chat_template"),
                   bos_token=None if bos is None else tokens[bos], eos_token=tokens[eos_ids[0]])

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json / chat_template.jinja / generation_config.json."""
        from replica import hf_checkpoint as hf

        folder = Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{folder} has no tokenizer.json (slow sentencepiece-only tokenizers are not "
                                    "supported: save one with transformers' AutoTokenizer(...).save_pretrained)")
        bos_token, eos_token = hf.special_token_strings(folder)
        return cls(BackendTokenizer.from_file(str(folder / "tokenizer.json")),
                   eos_token_ids=hf.eos_token_ids(folder), bos_token_id=hf.bos_token_id(folder),
                   chat_template=hf.chat_template(folder), bos_token=bos_token, eos_token=eos_token)

    @classmethod
    def from_spec(cls, spec: str) -> Tokenizer:
        """Any spec `replica.hf_checkpoint.resolve_model` accepts ("default", file, folder, hub id)."""
        from replica.hf_checkpoint import resolve_model

        path = resolve_model(spec, config_only=True)
        return cls.from_gguf(path) if path.endswith(".gguf") else cls.from_hf_dir(path)


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character standing for each byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


# Window bounds for IncrementalDetokenizer: the decoded window holds about
# _WINDOW tokens; when it slides, _CONTEXT already-emitted tokens stay in it as
# left context (decoders such as SentencePiece's strip a leading space from the
# first token of any decode). _MAX_PENDING bounds how long an unfinished UTF-8
# tail is held: normally one to three tokens; 16 tokens without reaching a whole
# character means invalid bytes or a literal U+FFFD, which are then emitted.
_WINDOW, _CONTEXT, _MAX_PENDING = 16, 4, 16
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Token ids in, text deltas out, for one stream.

    Offset tracking (as vLLM and Hugging Face's TextStreamer do it): only a short
    window of recent ids is kept; its first `read` ids are already turned into
    text (`window_text`). Each token decodes the window and emits what it adds
    beyond `window_text`. That keeps a step O(window) (about 3 us per token for
    the default model) and, because `read` always sits on a whole-character
    boundary, the deltas concatenate to exactly what a full decode gives.

    Two hold-backs: a window ending in U+FFFD ends inside a UTF-8 character, so
    nothing is emitted until a later token completes it; and with stop strings,
    a suffix that could still begin one waits until it cannot (or `flush()`).
    When a stop string appears, text is cut before it (after it with
    `include_stop`, vLLM's include_stop_str_in_output) and `stopped` is set.
    """

    def __init__(self, tokenizer: Tokenizer, stop=(), skip_special_tokens: bool = True, prefix_ids=(),
                 include_stop: bool = False):
        self._decode_fn = tokenizer.backend.decode
        self._skip = skip_special_tokens
        self._stops = tuple(s for s in stop if s)
        self._include_stop = include_stop  # the stop string ends the text instead of being cut
        self._ids: list[int] = []  # the window's ids and the pending ones after it
        self._read = 0  # self._ids[:read] are turned into text
        self._window_text = ""  # decode(self._ids[:read])
        self._held = ""  # text withheld because it could begin a stop string
        self._pieces: list[str] = []
        self.stopped = False
        self.stop_string: str | None = None  # which stop string ended the stream
        if prefix_ids:
            self._resume(list(prefix_ids))

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids, skip_special_tokens=self._skip)

    def add(self, ids) -> str:
        """The new text for `ids` (possibly "" while something is held back)."""
        if self.stopped:
            return ""
        new = []
        for i in ids:
            self._ids.append(i)
            delta = self._step()
            if delta:
                new.append(delta)
        return self._emit("".join(new), final=False)

    def flush(self) -> str:
        """End of stream: whatever is still held back (an unfinished character decodes as U+FFFD)."""
        if self.stopped:
            return ""
        tail = ""
        if self._read < len(self._ids):
            tail = self._decode(self._ids)[len(self._window_text):]
            self._read = len(self._ids)
            self._window_text += tail
        return self._emit(tail, final=True)

    def _step(self) -> str:
        text = self._decode(self._ids)
        if text.endswith(_REPLACEMENT) and len(self._ids) - self._read < _MAX_PENDING:
            return ""  # inside a UTF-8 character: wait for its remaining bytes
        delta = text[len(self._window_text):]
        self._read, self._window_text = len(self._ids), text
        if self._read > _WINDOW:
            # Slide: keep _CONTEXT emitted tokens as left context, unless they begin
            # mid-character (a leading U+FFFD); then try again on the next token.
            kept = self._ids[self._read - _CONTEXT:]
            kept_text = self._decode(kept)
            if not kept_text.startswith(_REPLACEMENT):
                self._ids, self._read, self._window_text = kept, _CONTEXT, kept_text
        return delta

    def _emit(self, new: str, final: bool) -> str:
        if self._stops:
            text = self._held + new
            cuts = [(i, s) for s in self._stops if (i := text.find(s)) >= 0]
            if cuts:
                cut, self.stop_string = min(cuts)
                cut += len(self.stop_string) if self._include_stop else 0
                new, self._held, self.stopped = text[:cut], "", True
            else:
                keep = 0 if final else self._stop_prefix_len(text)
                new, self._held = text[:len(text) - keep], text[len(text) - keep:]
        if new:
            self._pieces.append(new)
        return new

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _resume(self, prefix: list[int]) -> None:
        """Take the state a detokenizer that had seen `prefix` would have, emitting nothing:
        the last whole-character boundary and the held stop-string prefix (both depend only
        on the recent tokens, so a window of them suffices)."""
        self._ids = prefix[-(_WINDOW + _MAX_PENDING):]
        read = len(self._ids)
        text = self._decode(self._ids)
        while read > 0 and text.endswith(_REPLACEMENT) and len(self._ids) - read < _MAX_PENDING - 1:
            read -= 1
            text = self._decode(self._ids[:read])
        self._read, self._window_text = read, text
        if self._stops:
            self._emit(text, final=False)  # finds a stop string already passed, or what to hold
            self._pieces.clear()
