"""Weight-only block quantization for CPU decode: the weights stay 4 or 8 bits in memory.

Decode at small batch reads every weight once per step and does two flops per
weight, so a step costs the bytes it reads: fp32 SmolLM2-135M is 540 MB a token,
its GGUF (Q4_1 layers, a Q8_0 embedding that is also the head) 97 MB. Every
quantized weight here has GGUF's block form (`kernels.qgemm_cpu`):

    W[n, 32 b + i] = d[n, b] * u[n, 32 b + i] + m[n, b]

    --quantization int4   Q4_1's recipe on the dense weights (u in 0..15, min/max per block); head int8
    --quantization int8   Q8_0's recipe (symmetric per block: u = q + 128, m = -128 d)
    --quantization gguf   a GGUF file's Q4_0 / Q4_1 / Q8_0 tensors as stored; others as int8

The matmul runs on AVX-512 VNNI with the activations quantized per block to int16
(kernels/qgemm_cpu.py); the residual stream, norms, attention and KV stay in the
model's dtype. Without VNNI or a compiler the PyTorch reference serves (slowly).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

QUANTIZATIONS = ("none", "int8", "int4", "gguf")
BLOCK = 32  # input columns per scale and offset, GGUF's block


@dataclass
class QWeight:
    """qs (N, K * bits / 8) uint8 codes (4 bits: GGUF's nibble order per block);
    d, m (N, K / 32) fp32: W = d * u + m per block."""

    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor
    bits: int

    @staticmethod
    def cat(parts: list[QWeight]) -> QWeight:
        """Rows of several weights stacked (fused q/k/v or gate/up); one bit width."""
        if len({p.bits for p in parts}) != 1:
            raise ValueError("fused weights must share a bit width")
        return QWeight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("qs", "d", "m")), parts[0].bits)

    def dequantize(self) -> torch.Tensor:
        from kernels.qgemm_cpu import unpack_codes

        u = unpack_codes(self.qs, self.bits).float()
        rep = lambda t: t.repeat_interleave(BLOCK, dim=1)  # noqa: E731
        return u * rep(self.d) + rep(self.m)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    N, K = w.shape
    if K % (2 * BLOCK):
        raise ValueError(f"block quantization needs in_features divisible by {2 * BLOCK}, got {K}")
    return w.float().reshape(N, K // BLOCK, BLOCK)


def _pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """(N, K/32, 32) codes 0..15 -> (N, K/2) bytes, GGUF order (i low, i + 16 high)."""
    return (u[..., :16] | (u[..., 16:] << 4)).reshape(u.shape[0], -1)


def quantize_int4(w: torch.Tensor) -> QWeight:
    """Q4_1's recipe: per block, 16 levels from its min to its max."""
    g = _blocks(w)
    lo, hi = g.amin(-1), g.amax(-1)
    d = (hi - lo) / 15
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    u = ((g - lo[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
    return QWeight(_pack_nibbles(u), d, lo, 4)


def quantize_int8(w: torch.Tensor) -> QWeight:
    """Q8_0's recipe: per block, symmetric codes -127..127 stored offset by 128."""
    g = _blocks(w)
    d = g.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = (g * inv[..., None]).round().clamp(-127, 127)
    return QWeight((q + 128).to(torch.uint8).reshape(w.shape), d, -128 * d, 8)


GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0")


def from_gguf(raw: np.ndarray, qtype_name: str) -> QWeight:
    """A GGUF Q4_0 / Q4_1 / Q8_0 matrix (rows, bytes per row) without loss.

    Blocks of 32: fp16 d, (Q4_1: fp16 m), then the codes: Q4_x 16 bytes (code i in the
    low nibble of byte i, code i + 16 in the high one), Q8_0 32 signed bytes."""
    head = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2}[qtype_name]
    code_bytes = 32 if qtype_name == "Q8_0" else 16
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, head + code_bytes)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[..., head:].reshape(rows, -1)
    if qtype_name == "Q8_0":
        u = (codes.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return QWeight(torch.from_numpy(u), torch.from_numpy(d), torch.from_numpy(-128 * d), 8)
    m = -8 * d if qtype_name == "Q4_0" else blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return QWeight(torch.from_numpy(codes.copy()), torch.from_numpy(d), torch.from_numpy(m), 4)


class QLinear(nn.Module):
    """y = x W^T (+ bias) over a QWeight; `gemm` is the kernel chosen at start-up."""

    def __init__(self, w: QWeight, bias: torch.Tensor | None, gemm):
        super().__init__()
        self.out_features = w.qs.shape[0]
        self.in_features = w.qs.shape[1] * 8 // w.bits
        self.bits, self.gemm = w.bits, gemm
        self.register_buffer("qs", w.qs.contiguous())
        self.register_buffer("d", w.d.float().contiguous())
        self.register_buffer("m", w.m.float().contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32 and self.bias is None:  # the decode path: one call
            return self.gemm(x, self.qs, self.d, self.m, self.bits)
        y = self.gemm(x.reshape(-1, self.in_features).float(), self.qs, self.d, self.m, self.bits)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def _apply(self, fn, recurse=True):
        # model.to(dtype) must not cast the scales: the kernel reads them as fp32
        d, m = self.d, self.m
        super()._apply(fn, recurse)
        self.d, self.m = d.to(self.qs.device), m.to(self.qs.device)
        return self

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"


def choose_gemm():
    """The VNNI kernel where it builds and runs, else the PyTorch reference."""
    from kernels import qgemm_cpu

    return qgemm_cpu.qgemm_cpu if qgemm_cpu.available() else qgemm_cpu.qgemm_ref


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str, weights: dict[str, torch.Tensor],
                   stored: dict[str, QWeight] | None = None, gemm=None) -> nn.Module:
    """Replace the decoder's linears and the LM head by QLinears, in place.

    `weights`: the checkpoint's dense tensors by Hugging Face name (fp32 is best:
    they are quantized from these). `stored` (mode "gguf"): the file's quantized
    tensors; a linear whose parts are all there is served from them as they are,
    any other is quantized to int8. A tied head becomes its own quantized copy of
    the embedding (the lookup keeps the dense table: it reads one row a token)."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
    if mode == "none":
        return model
    if mode == "gguf" and stored is None:
        raise ValueError("--quantization gguf serves a GGUF file's own blocks: the model must be a .gguf file")
    gemm = gemm or choose_gemm()
    quantize = quantize_int4 if mode == "int4" else quantize_int8
    stored = stored or {}

    def linear(names: list[str], bias, recipe=quantize) -> QLinear:
        if all(n in stored for n in names) and len({stored[n].bits for n in names}) == 1:
            return QLinear(QWeight.cat([stored[n] for n in names]), bias, gemm)
        return QLinear(recipe(torch.cat([weights[n] for n in names])), bias, gemm)

    for i, layer in enumerate(model.layers):
        for part in ("self_attn", "mlp"):
            parent = getattr(layer, part)
            for name, lin in list(parent.named_children()):
                if isinstance(lin, nn.Linear):
                    names = [f"model.layers.{i}.{part}.{p}.weight" for p in _FUSED.get(name, (name,))]
                    setattr(parent, name, linear(names, lin.bias))
    # The head stays 8-bit: int4 logits moved SmolLM2's greedy answer (tests/replica/test_quant.py).
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    model.lm_head = linear([head], None, quantize_int8)
    return model
