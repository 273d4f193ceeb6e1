"""Weight-only quantized linears for CPU decode: weights stay int8/int4 in memory.

Decode at small batch reads every weight once per step and does two flops per
weight, so its time is the bytes read. fp32 SmolLM2-135M is 540 MB per token;
int8 is a quarter of that, int4 an eighth. torch ships CPU kernels for both:

    int8:  y = x @ (q * s[n])^T                 q int8 (N, K), one scale per row n
    int4:  y = x @ ((q - 8) * s[n, g] + z[n, g])^T   q in 0..15 packed two a byte,
                                                 scale and zero per group g of 32 columns

and runs them fast with bf16 activations (AVX-512 BF16); a quantized linear
casts its input to bf16 and its output back. GGUF's Q4_0 (w = d (q - 8)) and
Q4_1 (w = d q + m) are the int4 form with s = d, z = 0 or m + 8 d: served as-is
(`--quantization gguf`). Q8_0's per-32 scales have no int8 kernel; its tensors
(the default model's embedding, which is also its head) are requantized per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

QUANTIZATIONS = ("none", "int8", "int4", "gguf")
GROUP = 32  # int4 columns per scale/zero; GGUF's block size
ACT_DTYPE = torch.bfloat16  # the activation dtype the kernels are fast in


@dataclass
class Int4Weight:
    """Unpacked int4 weight: q (N, K) uint8 in 0..15; scale, zero (N, K // GROUP) fp32.
    Dequantized: (q - 8) * scale + zero, per group of GROUP columns."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Rows of several weights stacked (fused q/k/v or gate/up)."""
        return Int4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("q", "scale", "zero")))

    def dequantize(self) -> torch.Tensor:
        rep = lambda t: t.repeat_interleave(GROUP, dim=1)  # noqa: E731
        return (self.q.float() - 8) * rep(self.scale) + rep(self.zero)


def quantize_int4(w: torch.Tensor) -> Int4Weight:
    """Asymmetric min/max int4 per group of GROUP columns (the Q4_1 recipe)."""
    N, K = w.shape
    if K % GROUP:
        raise ValueError(f"int4 needs in_features divisible by {GROUP}, got {K}")
    g = w.float().reshape(N, K // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8).reshape(N, K)
    return Int4Weight(q, scale, lo + 8 * scale)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: (q (N, K) int8, scale (N,) fp32)."""
    scale = (w.float().abs().amax(-1) / 127).clamp_min(1e-12)
    return (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def gguf_int4(raw: np.ndarray, qtype_name: str) -> Int4Weight:
    """Q4_0 / Q4_1 blocks (rows, bytes per row) as an Int4Weight, without loss.

    A block of 32 weights: fp16 d, (Q4_1: fp16 m), then 16 bytes whose low nibbles
    are weights 0..15 and high nibbles weights 16..31."""
    head = {"Q4_0": 2, "Q4_1": 4}[qtype_name]
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, head + 16)  # (N, K/32, block bytes)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    qs = blocks[..., head:]
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(rows, -1)  # (N, K)
    if qtype_name == "Q4_0":
        zero = np.zeros_like(d)
    else:
        zero = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) + 8 * d
    return Int4Weight(torch.from_numpy(q.copy()), torch.from_numpy(d), torch.from_numpy(zero))


class Int8Linear(nn.Module):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("scale", scale.to(ACT_DTYPE))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, self.in_features).to(ACT_DTYPE), self.weight,
                                               self.scale)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


class Int4Linear(nn.Module):
    def __init__(self, w: Int4Weight, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = w.q.shape
        self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(w.q.to(torch.int32), 1))
        # (K / GROUP, N, 2): scale and zero of each group of each output row
        self.register_buffer("scale_zero", torch.stack([w.scale.t(), w.zero.t()], -1).to(ACT_DTYPE).contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, self.in_features).to(ACT_DTYPE), self.weight,
                                                       GROUP, self.scale_zero)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


def quantized_linear(w: torch.Tensor | Int4Weight, bias: torch.Tensor | None, mode: str) -> nn.Module:
    """The module serving weight `w` (dense, or int4 blocks read from a GGUF file)."""
    if isinstance(w, Int4Weight):
        return Int4Linear(w, bias)
    if mode == "int8" or w.shape[1] % GROUP:
        return Int8Linear(*quantize_int8(w), bias)
    return Int4Linear(quantize_int4(w), bias)


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str, weights: dict[str, torch.Tensor],
                   blocks: dict[str, Int4Weight] | None = None) -> nn.Module:
    """Replace the decoder's linears and the LM head by quantized ones, in place.

    `weights`: the checkpoint's dense tensors by Hugging Face name (fp32 is best:
    they are quantized from these). `blocks` (mode "gguf"): int4 weights read from
    the file; a linear whose parts are all there is served from them as stored, any
    other is quantized per row to int8. A tied head becomes its own quantized copy
    of the embedding (the lookup keeps the dense table)."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
    if mode == "none":
        return model
    if mode == "gguf" and blocks is None:
        raise ValueError("--quantization gguf serves a GGUF file's own int4 blocks: the model must be a .gguf file")
    dense_mode = "int8" if mode == "gguf" else mode
    blocks = blocks or {}

    def source(names: list[str]) -> torch.Tensor | Int4Weight:
        if all(n in blocks for n in names):
            return Int4Weight.cat([blocks[n] for n in names])
        return torch.cat([weights[n] for n in names])

    for i, layer in enumerate(model.layers):
        for part in ("self_attn", "mlp"):
            parent = getattr(layer, part)
            for name, lin in list(parent.named_children()):
                if isinstance(lin, nn.Linear):
                    parts = [f"model.layers.{i}.{part}.{p}.weight" for p in _FUSED.get(name, (name,))]
                    setattr(parent, name, quantized_linear(source(parts), lin.bias, dense_mode))
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    model.lm_head = quantized_linear(source([head]), None, dense_mode)
    return model
