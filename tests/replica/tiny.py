"""A tiny random Llama for fast engine tests (GQA 3:1, odd sizes on purpose)."""

from __future__ import annotations

import torch

from replica.config import ModelConfig


def tiny_config(**kw) -> ModelConfig:
    base = dict(vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6, num_kv_heads=2,
                rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512, eos_token_ids=(0,), name="tiny")
    base.update(kw)
    return ModelConfig(**base)


def tiny_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std=0.2):
        return torch.randn(*shape, generator=g) * std

    w = {"model.embed_tokens.weight": r(cfg.vocab_size, cfg.hidden_size, std=1.0),
         "model.norm.weight": 1 + r(cfg.hidden_size, std=0.1)}
    if not cfg.tie_word_embeddings:
        w["lm_head.weight"] = r(cfg.vocab_size, cfg.hidden_size)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + r(cfg.hidden_size, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + r(cfg.hidden_size, std=0.1)
        w[p + "self_attn.q_proj.weight"] = r(cfg.q_size, cfg.hidden_size)
        w[p + "self_attn.k_proj.weight"] = r(cfg.kv_size, cfg.hidden_size)
        w[p + "self_attn.v_proj.weight"] = r(cfg.kv_size, cfg.hidden_size)
        w[p + "self_attn.o_proj.weight"] = r(cfg.hidden_size, cfg.q_size)
        if cfg.attention_bias:
            for n, size in (("q", cfg.q_size), ("k", cfg.kv_size), ("v", cfg.kv_size)):
                w[p + f"self_attn.{n}_proj.bias"] = r(size)
        w[p + "mlp.gate_proj.weight"] = r(cfg.intermediate_size, cfg.hidden_size)
        w[p + "mlp.up_proj.weight"] = r(cfg.intermediate_size, cfg.hidden_size)
        w[p + "mlp.down_proj.weight"] = r(cfg.hidden_size, cfg.intermediate_size)
    return w


def tiny_tokenizer():
    """A byte-level tokenizer for the tiny model's 97 ids: 0 is EOS, then one token per
    printable ASCII character and newline (structured-output tests need real text)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    from replica.tokenizer import Tokenizer, _byte_decoder

    char_of = {b: ch for ch, b in _byte_decoder().items()}
    vocab = {"<eos>": 0}
    for b in [*range(32, 127), 10]:
        vocab[char_of[b]] = len(vocab)
    backend = Backend(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken("<eos>", special=True)])
    return Tokenizer(backend, eos_token_ids=(0,), eos_token="<eos>")
