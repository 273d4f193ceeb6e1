"""Shapes of well-known models, served with random weights (`--random-weights`): timing
any shape with nothing to download. Torch-free: the API process and the proxy read a
preset's tokenizer and config from here.

A preset has no tokenizer of its own, so `preset_dir(name)` writes (once, under
~/.cache/edgechat/presets/) a Hugging Face folder for it: the preset's config.json and
a byte-level BPE tokenizer whose vocabulary spans exactly the preset's vocab_size (the
256 byte symbols, the preset's BOS/EOS ids as special tokens, and a word " xyz..." for
every other id), so every id a random model samples streams as text, with a ChatML
template. `replica.hf_checkpoint.resolve_model(name, config_only=True)` returns that
folder, so `python -m replica --model llama-3.1-8b --random-weights` and a proxy with
`--tokenizer llama-3.1-8b` agree on one tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from replica.config import ModelConfig, RopeScaling

# Shapes of well-known models, for timing with random weights (no download).
_LLAMA3_SCALING = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)
PRESETS: dict[str, ModelConfig] = {
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
        eos_token_ids=(2,), name="smollm2-135m"),
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
        head_dim=64, rope_theta=500000.0, rope_scaling=RopeScaling(factor=32.0, **_LLAMA3_SCALING),
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009), name="llama-3.2-1b"),
    "llama-3.1-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        rope_theta=500000.0, rope_scaling=RopeScaling(factor=8.0, **_LLAMA3_SCALING),
        max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
        name="llama-3.1-8b"),
    "llama-2-7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32, num_kv_heads=32,
        max_position_embeddings=4096, bos_token_id=1, eos_token_ids=(2,), name="llama-2-7b"),
    "qwen2.5-0.5b": ModelConfig(
        vocab_size=151936, hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True,
        attention_bias=True, bos_token_id=151643, eos_token_ids=(151645, 151643), name="qwen2.5-0.5b"),
    "mistral-7b": ModelConfig(  # v0.3 (32768-token vocabulary); sliding window unused from v0.2 on
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
        rope_theta=1000000.0, max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,), name="mistral-7b"),
}


CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                 "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _word(k: int) -> str:
    """Distinct lower-case words for k = 0, 1, ... (bijective base 26: a..z, aa, ab, ...)."""
    out = []
    k += 1
    while k:
        k, r = divmod(k - 1, 26)
        out.append(chr(ord("a") + r))
    return "".join(reversed(out))


def write_preset_folder(name: str, dest: Path) -> Path:
    """Into the existing folder `dest`, a Hugging Face folder for PRESETS[name]: config.json, tokenizer.json (a vocabulary of
    exactly vocab_size ids, see the module docstring), tokenizer_config.json with the chat
    template (tests/replica/test_presets.py: it reads back as the preset)."""
    cfg = PRESETS[name]
    V = cfg.vocab_size
    eos = list(cfg.eos_token_ids)
    specials = {eos[0]: "<|im_end|>"}  # the turn's end is the first EOS (ChatML)
    specials.update({i: f"<|eos_{k}|>" for k, i in enumerate(eos[1:], 1)})
    if cfg.bos_token_id is not None and cfg.bos_token_id not in specials:
        specials[cfg.bos_token_id] = "<|bos|>"
    start_id = next(i for i in range(V - 1, -1, -1) if i not in specials)
    specials[start_id] = "<|im_start|>"
    alphabet = iter(sorted(pre_tokenizers.ByteLevel.alphabet()))
    vocab, k = {}, 0
    for i in range(V):
        if i in specials:
            vocab[specials[i]] = i
        elif (ch := next(alphabet, None)) is not None:
            vocab[ch] = i
        else:
            vocab["\u0120" + _word(k)] = i  # "Ġ" is the byte-level space: decodes to " word"
            k += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials.values()])
    assert tok.get_vocab_size(with_added_tokens=True) == V, (tok.get_vocab_size(with_added_tokens=True), V)
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": specials.get(cfg.bos_token_id), "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
    rs = cfg.rope_scaling
    (dest / "config.json").write_text(json.dumps({
        "model_type": "qwen2" if cfg.attention_bias else "llama", "vocab_size": V, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_scaling": dataclasses.asdict(rs) if rs else None,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": eos}, indent=1))
    return dest


def preset_dir(name: str) -> Path:
    """The preset's Hugging Face folder, written on first use (atomically: a folder being
    written is never seen half done by another process)."""
    root = Path(os.environ.get("EDGECHAT_PRESETS_DIR", Path.home() / ".cache" / "edgechat" / "presets"))
    folder = root / name
    if (folder / "config.json").is_file():
        return folder
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    write_preset_folder(name, tmp)
    try:
        tmp.rename(folder)
    except OSError:  # another process won the race: use its folder
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
