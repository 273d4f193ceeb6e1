"""Tokenizer, chat template and incremental detokenizer on the default model's GGUF vocabulary."""

import json
import random
import subprocess
import sys

import pytest

from replica.gguf_file import GGUFFile
from replica.hf_checkpoint import default_model_path
from replica.tokenizer import ChatTemplateError, IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing tabs\t\t\nand\n\nblank lines  ",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, עברית, العربية",
    "日本語のテキストと中文文本，한국어 텍스트",
    "emoji 😀🎉 skin tone 👍🏽 family 👨‍👩‍👧‍👦 flag 🇫🇷 keycap 1️⃣",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # O(2**n)\n",
    'x = {"a": [1, 2.5e-3, -7], "b": null}; y = x["a"][0] ** 2 // 3',
    "in 2024 the price was $1,234.56 (up 7.8%) — call +1-555-0100",
    "math: ∀x ∈ ℝ, x² ≥ 0; ∫₀¹ f(x) dx ≈ 3.14159",
    "",
]
SYSTEM_DEFAULT = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


@pytest.fixture(scope="module")
def gguf() -> GGUFFile:
    return GGUFFile(default_model_path())


def test_import_pulls_in_no_torch():
    code = ("import sys; from replica.tokenizer import Tokenizer; t = Tokenizer.from_spec('default'); "
            "assert t.encode('<|im_end|>') == [2]; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_vocabulary_and_special_ids_come_from_the_file(tok, gguf):
    tokens = gguf.metadata["tokenizer.ggml.tokens"]
    types = gguf.metadata["tokenizer.ggml.token_type"]
    assert tok.vocab_size == len(tokens) == 49152
    assert tokens[1] == "<|im_start|>" and tokens[2] == "<|im_end|>" and tokens[0] == "<|endoftext|>"
    assert tok.bos_token_id == gguf.metadata["tokenizer.ggml.bos_token_id"] == 1
    assert tok.eos_token_ids == (gguf.metadata["tokenizer.ggml.eos_token_id"],) == (2,)
    for i, (token, kind) in enumerate(zip(tokens, types)):
        if kind == 3:  # control tokens: one id each, never split
            assert tok.encode(token) == [i], token
            assert tok.encode(f"a{token}b") == tok.encode("a") + [i] + tok.encode("b")


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert all(0 <= i < tok.vocab_size for i in ids)


def test_digits_are_one_token_each(tok):
    ids = tok.encode("year 2024, pi=3.14159 and 1234567890")
    pieces = [tok.decode([i]) for i in ids]
    assert "".join(pieces) == "year 2024, pi=3.14159 and 1234567890"
    digit_pieces = [p for p in pieces if any(c.isdigit() for c in p)]
    assert digit_pieces == list("2024314159") + list("1234567890")
    assert len(tok.encode("1234567890")) == 10


def test_special_tokens_in_text_and_skipping_on_decode(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and ids.count(1) == 1 and ids.count(2) == 1
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.encode("plain text", add_special_tokens=True) == tok.encode("plain text", add_special_tokens=False)


def test_chat_template_renders_chatml_exactly(tok):
    convo = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "2+2?"}]
    assert tok.apply_chat_template(convo) == (
        SYSTEM_DEFAULT + "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    with_system = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


def test_encode_chat(tok):
    convo = [{"role": "user", "content": "What is 12 × 3? 🤔"}]
    ids = tok.encode_chat(convo)
    rendered = tok.apply_chat_template(convo)
    assert ids == tok.encode(rendered, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == rendered
    assert ids.count(1) == 3 and ids.count(2) == 2  # system, user, assistant turns opened; two closed
    assert ids[-4:] == [1] + tok.encode("assistant\n")


def test_template_errors_are_chat_template_errors(tok):
    template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
    raising = Tokenizer(tok.backend, eos_token_ids=(2,), chat_template=template)
    assert raising.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ChatTemplateError, match="user first"):
        raising.apply_chat_template([{"role": "assistant", "content": "x"}])
    mutating = Tokenizer(tok.backend, eos_token_ids=(2,), chat_template="{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError, match="chat template failed"):  # the sandbox is immutable
        mutating.apply_chat_template([])
    with pytest.raises(ChatTemplateError, match="chat template failed"):  # str + None inside the template
        tok.apply_chat_template([{"role": "assistant", "content": None}])
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(tok.backend, eos_token_ids=(2,)).apply_chat_template([])


def test_template_environment_matches_hugging_face(tok):
    template = ("{% for m in messages %}\n  {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
                "{{ m.content | tojson }}|{{ bos_token }}{{ eos_token }}\n{% endfor %}")
    t = Tokenizer(tok.backend, eos_token_ids=(2,), chat_template=template, bos_token="<s>", eos_token="</s>")
    out = t.apply_chat_template([{"role": "user", "content": "é<&>"}, {"role": "skip", "content": "x"}])
    assert out == '"é<&>"|<s></s>\n'  # trim_blocks + lstrip_blocks, loopcontrols, unescaped tojson


def test_from_hf_dir_matches_gguf(tok, tmp_path):
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tok.chat_template, "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert hf.eos_token_ids == (0, 2)  # generation_config's, plus <|im_end|> for a ChatML template
    assert hf.bos_token_id == 1 and hf.vocab_size == tok.vocab_size
    convo = [{"role": "user", "content": TEXTS[4]}]
    assert hf.encode_chat(convo) == tok.encode_chat(convo)
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text)


# -- incremental detokenization ----------------------------------------------------------

MULTIBYTE = "naïve 😀🎉 日本語 👨‍👩‍👧‍👦 ∫₀¹ x² dx\n🇫🇷 done"


def stream(detok: IncrementalDetokenizer, ids, chunks=None) -> list[str]:
    deltas, i = [], 0
    for n in chunks or [1] * len(ids):
        deltas.append(detok.add(ids[i:i + n]))
        i += n
    return deltas


def test_multibyte_text_needs_holding_back(tok):
    ids = tok.encode(MULTIBYTE)
    # Some tokens end inside a UTF-8 character: naive per-token decoding would show U+FFFD.
    assert any("\ufffd" in tok.decode(ids[:n]) for n in range(1, len(ids)))


@pytest.mark.parametrize("text", TEXTS + [MULTIBYTE])
def test_token_by_token_equals_full_decode(tok, text):
    ids = tok.encode(text) + tok.encode(text)  # long enough for the window to slide
    detok = IncrementalDetokenizer(tok)
    deltas = stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == tok.decode(ids) == detok.text


def test_random_chunks_and_special_tokens(tok):
    ids = tok.encode_chat([{"role": "user", "content": MULTIBYTE}]) + tok.encode(MULTIBYTE) + [2]
    rng = random.Random(0)
    for skip in (True, False):
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(rng.randint(1, 5))
        detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
        deltas = stream(detok, ids, chunks)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) + detok.flush() == tok.decode(ids, skip_special_tokens=skip)


def test_unfinished_character_comes_out_at_flush(tok):
    ids = tok.encode("ok 😀")
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok)
    emitted = "".join(stream(detok, ids[:cut]))
    assert emitted.startswith("ok") and "\ufffd" not in emitted
    tail = detok.flush()
    assert tail.endswith("\ufffd")  # the stream ended inside a character: show what a full decode shows
    assert emitted + tail == tok.decode(ids[:cut])


def test_stop_string_spanning_tokens(tok):
    text = "The capital of France is Paris. The capital of Spain is Madrid."
    ids = tok.encode(text)
    for stop in (["al of Fr"], ["Paris. The"], ["Madrid", "is Paris"]):
        spans = [s for s in stop if s in text]
        first = min(text.index(s) for s in spans)
        detok = IncrementalDetokenizer(tok, stop=stop)
        deltas = stream(detok, ids)
        assert detok.stopped and detok.stop_string in stop
        assert "".join(deltas) == detok.text == text[:first]
        assert detok.add(tok.encode(" more")) == "" and detok.flush() == ""
    assert tok.decode(tok.encode("Paris. The")) == "Paris. The" and len(tok.encode("al of Fr")) > 1


def test_possible_stop_prefix_is_held_then_released(tok):
    detok = IncrementalDetokenizer(tok, stop=["</answer>"])
    assert detok.add(tok.encode("The answer is 42")) == "The answer is 42"
    assert detok.add(tok.encode("</ans")) == ""  # could still become the stop string
    assert detok.add(tok.encode("wer")) == ""
    assert detok.text == "The answer is 42"
    assert detok.flush() == "</answer"  # the stream ended first: nothing is lost
    assert not detok.stopped

    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    assert detok.add(tok.encode("go ST")) == "go "
    assert detok.add(tok.encode("ART now")) == "START now"  # turned out not to be the stop string
    assert not detok.stopped


def test_prefix_ids_set_state_but_emit_nothing(tok):
    ids = tok.encode(MULTIBYTE + " " + MULTIBYTE)
    full = tok.decode(ids)
    for n in range(len(ids) + 1):
        before = IncrementalDetokenizer(tok)
        emitted = "".join(stream(before, ids[:n]))  # what the first replica sent before dying
        resumed = IncrementalDetokenizer(tok, prefix_ids=ids[:n])
        assert resumed.text == "" and resumed.add([]) == ""
        rest = resumed.add(ids[n:]) + resumed.flush()
        assert "\ufffd" not in rest
        assert emitted + rest == full, n
        assert resumed.text == rest


def test_prefix_ids_with_stop_strings(tok):
    text = "alpha beta </stop> gamma"
    ids = tok.encode(text)
    for n in range(len(ids) + 1):
        before = IncrementalDetokenizer(tok, stop=["</stop>"])
        emitted = "".join(stream(before, ids[:n]))
        resumed = IncrementalDetokenizer(tok, stop=["</stop>"], prefix_ids=ids[:n])
        rest = resumed.add(ids[n:]) + resumed.flush()
        assert emitted + rest == "alpha beta ", n
        assert resumed.stopped


def test_fingerprint_names_what_maps_text_to_ids(tok):
    """Same file, same fingerprint (the proxy and the replica load it separately); any change
    to the vocabulary, the template or the special ids gives another."""
    assert Tokenizer.from_gguf(default_model_path()).fingerprint == tok.fingerprint
    kw = dict(eos_token_ids=tok.eos_token_ids, bos_token_id=tok.bos_token_id, chat_template=tok.chat_template)
    assert Tokenizer(tok.backend, **kw).fingerprint == tok.fingerprint
    assert Tokenizer(tok.backend, **{**kw, "chat_template": tok.chat_template + " "}).fingerprint != tok.fingerprint
    assert Tokenizer(tok.backend, **{**kw, "eos_token_ids": (7,)}).fingerprint != tok.fingerprint
    other = Tokenizer.from_gguf(default_model_path())
    other.backend.add_tokens(["<|edgechat-extra|>"])
    assert Tokenizer(other.backend, **kw).fingerprint != tok.fingerprint
