"""Weight-only block quantization for CPU decode: the weights stay 4 or 8 bits in memory.

Decode at small batch reads every weight once per step and does two flops per
weight, so a step costs the bytes it reads: fp32 SmolLM2-135M is 540 MB a token,
its GGUF (Q4_1 layers, a Q8_0 embedding that is also the head) 97 MB. Every
quantized weight here has GGUF's block form (`kernels.qgemm_cpu`):

    W[n, 32 b + i] = d[n, b] * u[n, 32 b + i] + m[n, b]          d, m fp16 values, as GGUF stores them

    --quantization int4   Q4_1's recipe on the dense weights (u in 0..15, min/max per block); head int8
    --quantization int8   Q8_0's recipe (symmetric per block: u = q + 128, m = -128 d)
    --quantization gguf   a GGUF file's Q4_0 / Q4_1 / Q8_0 tensors as stored; others as int8

The matmul runs on AVX-512 VNNI with the activations quantized per block to int16
(kernels/qgemm_cpu.py, over weights packed once at load); the residual stream,
norms, attention and KV stay in the model's dtype. Without VNNI or a compiler the
PyTorch reference serves (slowly). On CPU the whole step runs in one C++ call over
the same packed weights (replica/model/cpu_model.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kernels import qgemm_cpu

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
        u = qgemm_cpu.unpack_codes(self.qs, self.bits).float()
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


def _fp16(t: torch.Tensor) -> torch.Tensor:
    """Scales and offsets are stored as fp16 (GGUF's choice; the packed kernel reads them so)."""
    return t.half().float()


def quantize_int4(w: torch.Tensor) -> QWeight:
    """Q4_1's recipe: per block, 16 levels from its min to its max (d and min rounded to fp16)."""
    g = _blocks(w)
    lo, hi = _fp16(g.amin(-1)), g.amax(-1)
    d = _fp16((hi - lo) / 15)
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    u = ((g - lo[..., None]) * inv[..., None]).round().clamp(0, 15).to(torch.uint8)
    return QWeight(_pack_nibbles(u), d, lo, 4)


def quantize_int8(w: torch.Tensor) -> QWeight:
    """Q8_0's recipe: per block, symmetric codes -127..127 stored offset by 128 (d rounded to fp16)."""
    g = _blocks(w)
    d = _fp16(g.abs().amax(-1) / 127)
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
    """y = x W^T (+ bias) over a QWeight: the packed VNNI kernel when `packed`, else
    the PyTorch reference. The codes, scales and offsets stay as buffers (the C++
    step repacks the fused gate/up rows from them)."""

    def __init__(self, w: QWeight, bias: torch.Tensor | None, packed: bool):
        super().__init__()
        self.out_features = w.qs.shape[0]
        self.in_features = w.qs.shape[1] * 8 // w.bits
        self.bits = w.bits
        self.register_buffer("qs", w.qs.contiguous())
        self.register_buffer("d", w.d.float().contiguous())
        self.register_buffer("m", w.m.float().contiguous())
        packed = packed and qgemm_cpu.packable(self.out_features, self.in_features)
        self.register_buffer("packed", qgemm_cpu.pack(self.qs, self.d, self.m, self.bits) if packed else None)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def shell(cls, out_features: int, in_features: int, bits: int, bias: bool) -> QLinear:
        """A QLinear without tensors, to be filled from a kept build (replica.model.built):
        its buffers are None (packed too) and its bias, if any, a parameter on the
        current device (meta there)."""
        q = cls.__new__(cls)
        nn.Module.__init__(q)
        q.out_features, q.in_features, q.bits = out_features, in_features, bits
        for name in ("qs", "d", "m", "packed"):
            q.register_buffer(name, None)
        q.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        return q

    @property
    def weight(self) -> QWeight:
        return QWeight(self.qs, self.d, self.m, self.bits)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return qgemm_cpu.qgemm_cpu(x, self.packed, self.out_features, self.bits)
        return qgemm_cpu.qgemm_ref(x, self.qs, self.d, self.m, self.bits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.dtype == torch.float32 and self.bias is None:  # the decode path: one call
            return self._gemm(x)
        y = self._gemm(x.reshape(-1, self.in_features).float())
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


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@torch.no_grad()
def quantize_model(model: nn.Module, mode: str, weights: dict[str, torch.Tensor],
                   stored: dict[str, QWeight] | None = None, packed: bool | None = None) -> nn.Module:
    """Replace the decoder's linears and the LM head by QLinears, in place.

    `weights`: the checkpoint's dense tensors by Hugging Face name (fp32 is best:
    they are quantized from these). `stored` (mode "gguf"): the file's quantized
    tensors; a linear whose parts are all there is served from them as they are,
    any other is quantized to int8. `packed`: serve through the VNNI kernel
    (default: as the model's kernel set says, `kernels.Ops.packed_qgemm`). A tied head becomes its own quantized copy of
    the embedding (the lookup keeps the dense table: it reads one row a token)."""
    if mode not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {mode!r}")
    if mode == "none":
        return model
    if mode == "gguf" and stored is None:
        raise ValueError("--quantization gguf serves a GGUF file's own blocks: the model must be a .gguf file")
    packed = model.ops.packed_qgemm if packed is None else packed
    quantize = quantize_int4 if mode == "int4" else quantize_int8
    stored = stored or {}

    def linear(names: list[str], bias, recipe=quantize) -> QLinear:
        if all(n in stored for n in names) and len({stored[n].bits for n in names}) == 1:
            return QLinear(QWeight.cat([stored[n] for n in names]), bias, packed)
        return QLinear(recipe(torch.cat([weights[n] for n in names])), bias, packed)

    for i, layer in enumerate(model.layers):
        for part in ("self_attn", "mlp"):
            parent = getattr(layer, part)
            for name, lin in list(parent.named_children()):
                if isinstance(lin, nn.Linear):
                    names = [f"model.layers.{i}.{part}.{p}.weight" for p in _FUSED.get(name, (name,))]
                    setattr(parent, name, linear(names, lin.bias))
    # The head stays 8-bit: int4 logits moved SmolLM2's greedy answer (tests/replica/model/test_quant.py).
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    model.lm_head = linear([head], None, quantize_int8)
    return model
