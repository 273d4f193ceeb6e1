"""A Llama-family decoder step in one C++ call on CPU: the analogue of a replayed CUDA graph.

A step of SmolLM2-135M at batch 1 is ~1.5 ms of arithmetic, yet issuing it op by
op from Python costs ~500 dispatches (several ms). `Decoder` holds the packed
4/8-bit weights (kernels/qgemm_cpu.py) and runs the whole forward of a step's T
tokens in one call (kernels/csrc/cpu_forward.cpp), its phases shared out over every
core by a work-claiming pool (csrc/include/edgechat/pool.h): per layer

    x += o(attn(rope(qkv(norm(x)))))         qkv split by rows of W among threads; KV stored; attention per (token, head)
    x += down(silu(gate(norm(x))) * up(...))  gate/up rows interleaved by 32 so a thread's rows pair up

each phase finished before the next starts (six a layer). The residual stream x is one fp32
(T, hidden) buffer that the o and down matmuls add into. Attention reads keys and
values from the paged pool through the block tables (decode rows, prefill chunks
with their causal lengths, draft trees with their masks), so the KV pool and the
block tables are passed in and nothing is gathered. The pool is fp16 (the default,
`kernels.Ops.cpu_step_kv`: half the bytes a long context's decode reads), fp32, or
int8 with a scale per (token, kv head) (kernels/paged.py: a row is head_dim codes and
4 bytes of scale): k and v are rounded to it when stored, and attention reads them
as stored, widening to fp32 as it loads them (the int8 scales folded into the scores
and the probability weights); the scores, softmax and sums are fp32.

Same math as `replica.model.llama.LlamaModel` over `replica.model.quant.QLinear`s (the
reference, over a pool of the same dtype: its store rounds to nearest even as the
step's does; tests/kernels/test_cpu_forward.py compares them within 3e-4 of the
values' scale over fp32, 1e-3 over fp16 and int8): the same int16 activation rounding, norm, rotate-half RoPE, SwiGLU
and softmax formulas (exp vectorized), summed in other orders. A row's result
never depends on the other rows of its step nor on the thread count (per-row
arithmetic only), so batching keeps seeded samples.
"""

from __future__ import annotations

import torch

from kernels.cpu_build import builds, load_cpp


def _ext():
    return load_cpp("edgechat_cpu_forward", "cpu_forward.cpp")


def available() -> bool:
    """The decoder step builds (once per machine) and runs here (AVX-512 VNNI)."""
    from kernels import qgemm_cpu

    return qgemm_cpu.available() and builds(_ext, "kernels.cpu_forward: the C++ step", "running op by op")


def solo_would_win(chunks: int, helped: int, wall_ns: int, waited_ns: int) -> bool:
    """The pool's verdict on a step run on both threads (edgechat/pool.h): whether the steps after it run on the
    caller alone."""
    return _ext().solo_would_win(chunks, helped, wall_ns, waited_ns)


def interleave_gate_up(n_inter: int) -> torch.Tensor:
    """Row order of a fused (gate; up) weight for the step: 32 gate rows, then the same
    32 rows of up, and so on, so each 64-row supertile yields 32 SwiGLU outputs."""
    return torch.arange(2 * n_inter).reshape(2, n_inter // 32, 32).transpose(0, 1).reshape(-1)


def decoder(shape: tuple[int, int, int, int, int, int], eps: float, embed: torch.Tensor, cos_sin: torch.Tensor,
            final_norm: torch.Tensor, norms: list[torch.Tensor], biases: list[torch.Tensor | None],
            packed: list[torch.Tensor], bits: list[int], head: torch.Tensor, head_bits: int, threads: int):
    """The C++ `Decoder`. shape = (hidden, heads, kv_heads, head_dim, intermediate, layers);
    per layer: norms (input, post-attention), a qkv bias or None, packed weights and bits
    of (qkv, o, gate/up interleaved by `interleave_gate_up`, down); the packed head."""
    empty = torch.empty(0)
    return _ext().Decoder(list(shape), eps, embed, cos_sin, final_norm, norms,
                          [empty if b is None else b.float().contiguous() for b in biases], packed, bits, head,
                          head_bits, threads)


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, plain0: int,
                     blocked: bool) -> torch.Tensor:
    """The step's attention for nq consecutive prompt tokens of one sequence over one layer's
    pool (one thread): q (nq, heads, head_dim) fp32, k and v (blocks, page, kv_heads, head_dim)
    as the pool stores them, table the sequence's blocks (int32); token i sees keys
    [0, plain0 + i). `blocked`: the kernel the step runs for a prompt's int8 (narrow) rows,
    tokens in blocks over each key once; else the one-token kernel of every other row."""
    return _ext().prompt_attention(q, k, v, table, plain0, blocked)


def block_bf16() -> bool:
    """Whether the blocked kernel's products run on bf16 pairs (a CPU with AVX512_BF16; the
    softmax stays fp32), else fp32 as the one-token kernel."""
    return bool(_ext().block_bf16)
