"""A plain, no-cache Llama forward written from the architecture alone (no
kernels, no paging): the yardstick the engine's logits are checked against."""

from __future__ import annotations

import torch

from replica.config import ModelConfig
from replica.model.llama import rope_inv_freq


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, inv_freq):  # x (T, H, D), rotate-half convention
    f = torch.outer(pos.double(), inv_freq.double()).float()  # (T, D/2)
    cos, sin = torch.cat([f.cos()] * 2, -1)[:, None], torch.cat([f.sin()] * 2, -1)[:, None]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


@torch.no_grad()
def reference_logits(cfg: ModelConfig, w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """(T, vocab) fp32 logits of every position of `ids`."""
    T, H, Hkv, D = len(ids), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pos = torch.arange(T)
    inv_freq = rope_inv_freq(cfg)
    x = w["model.embed_tokens.weight"].float()[torch.tensor(ids)]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."

        def lin(name, inp):
            out = inp @ w[p + name + ".weight"].float().T
            b = w.get(p + name + ".bias")
            return out if b is None else out + b.float()

        h = _rms(x, w[p + "input_layernorm.weight"].float(), cfg.rms_norm_eps)
        q = _rope(lin("self_attn.q_proj", h).view(T, H, D), pos, inv_freq)
        k = _rope(lin("self_attn.k_proj", h).view(T, Hkv, D), pos, inv_freq)
        v = lin("self_attn.v_proj", h).view(T, Hkv, D)
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
        s = torch.einsum("thd,shd->hts", q, k) / D**0.5
        a = torch.einsum("hts,shd->thd", s.masked_fill(~mask, float("-inf")).softmax(-1), v)
        x = x + lin("self_attn.o_proj", a.reshape(T, H * D))
        h = _rms(x, w[p + "post_attention_layernorm.weight"].float(), cfg.rms_norm_eps)
        x = x + lin("mlp.down_proj", torch.nn.functional.silu(lin("mlp.gate_proj", h)) * lin("mlp.up_proj", h))
    x = _rms(x, w["model.norm.weight"].float(), cfg.rms_norm_eps)
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"]).float()
    return x @ head.T
