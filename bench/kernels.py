"""Benchmark the replica's hot-path kernels on a GPU.

For each kernel and shape: Triton time, achieved bandwidth (bytes the kernel must
move / time), that bandwidth as a fraction of the measured device-to-device copy
bandwidth, and the PyTorch reference's time (plus F.scaled_dot_product_attention
on dense, non-paged K/V where it applies). Times are medians of
triton.testing.do_bench, which flushes L2 between runs, so bandwidth is HBM's.

    .venv/bin/python bench/kernels.py            # everything, ~3-5 minutes on an H100
    .venv/bin/python bench/kernels.py --only decode,rmsnorm --quick

Attention shapes are Llama-3-8B's (32 query / 8 kv heads, head_dim 128, bf16,
16-token blocks) unless --heads/--kv-heads/--head-dim say otherwise.
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import kernels  # noqa: E402
from kernels import decode_attention, extend_attention, rmsnorm, rotary, sampling, store_kv, swiglu  # noqa: E402
from kernels import tree_attention  # noqa: E402

REF_LIMIT_BYTES = 6 << 30  # skip a reference whose fp32 intermediates would exceed this
DEVICE = "cuda"

# Shapes: (full, --quick).
DECODE_BATCHES = ([1, 8, 32, 64], [1, 32])
DECODE_CONTEXTS = ([512, 4096, 16384, 32768], [4096, 32768])
# (batch, new tokens per sequence, cached prefix per sequence)
EXTEND_CASES = ([(1, 512, 0), (1, 2048, 0), (1, 8192, 0), (1, 2048, 30720), (8, 512, 3584), (32, 64, 4096)],
                [(1, 2048, 0), (8, 512, 3584)])  # fmt: skip
TREE_DRAFTS = 16  # drafts per sequence (an EAGLE tree)
TREE_BATCHES = ([1, 8, 32, 64], [1, 32])
TREE_CONTEXTS = ([512, 4096, 32768], [4096])
ELEMENTWISE_TOKENS = ([1, 64, 1024, 8192, 32768], [64, 8192])
HIDDEN, INTERMEDIATE = 4096, 14336  # Llama-3-8B
SAMPLING_BATCHES = ([1, 8, 32, 64], [1, 32])
VOCABS = [49152, 128256]  # SmolLM2, Llama 3


class Table:
    def __init__(self, copy_gbps: float):
        self.copy_gbps = copy_gbps
        print(f"{'kernel':<20} {'shape':<34} {'triton us':>10} {'GB/s':>8} {'% copy':>7} {'ref us':>10} "
              f"{'sdpa us':>9} {'x ref':>7}")  # fmt: skip

    def row(self, name, shape, ms, nbytes, ref_ms=None, sdpa_ms=None, extra=""):
        gbps = nbytes / ms / 1e6
        ref = f"{ref_ms * 1e3:10.1f}" if ref_ms is not None else f"{'-':>10}"
        sdpa = f"{sdpa_ms * 1e3:9.1f}" if sdpa_ms is not None else f"{'-':>9}"
        speedup = f"{ref_ms / ms:7.1f}" if ref_ms is not None else f"{'-':>7}"
        print(f"{name:<20} {shape:<34} {ms * 1e3:10.1f} {gbps:8.0f} {100 * gbps / self.copy_gbps:6.1f}% {ref} {sdpa} "
              f"{speedup} {extra}", flush=True)  # fmt: skip


def bench(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=40, return_mode="median")


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write counted)."""
    x = torch.empty(1 << 28, dtype=torch.float32, device=DEVICE).normal_()
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() * 4 / ms / 1e6


def paged_pool(lens, hkv, d, dtype, page=16):
    """A pool holding `lens` tokens per sequence in shuffled blocks, with block tables."""
    need = [-(-n // page) for n in lens]
    num_blocks = sum(need)
    k_cache = torch.randn(num_blocks, page, hkv, d, device=DEVICE, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device=DEVICE).int()
    block_tables = torch.zeros(len(lens), max(need), dtype=torch.int32, device=DEVICE)
    used = 0
    for b, n in enumerate(need):
        block_tables[b, :n] = perm[used : used + n]
        used += n
    return k_cache, v_cache, block_tables


def bench_decode(t, args, ops):
    h, hkv, d, dt = args.heads, args.kv_heads, args.head_dim, torch.bfloat16
    for b in DECODE_BATCHES[args.quick]:
        for ctx in DECODE_CONTEXTS[args.quick]:
            k_cache, v_cache, bt = paged_pool([ctx] * b, hkv, d, dt)
            q = torch.randn(b, h, d, device=DEVICE, dtype=dt)
            seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=DEVICE)
            scale = d**-0.5
            ms = bench(lambda: ops.paged_decode_attention(q, k_cache, v_cache, bt, seq_lens, scale))
            nbytes = 2 * k_cache.numel() * k_cache.element_size() + 2 * q.numel() * q.element_size()
            ref_ms = None
            if 2 * k_cache.numel() * 4 <= REF_LIMIT_BYTES:
                ref_ms = bench(lambda: decode_attention.paged_decode_attention_ref(q, k_cache, v_cache, bt, seq_lens,
                                                                                   scale))  # fmt: skip
            # dense baseline: the same keys contiguous, (B, Hkv, L, D), GQA inside SDPA
            kd = k_cache.view(b, -1, hkv, d).transpose(1, 2).contiguous()
            vd = v_cache.view(b, -1, hkv, d).transpose(1, 2).contiguous()
            qd = q[:, :, None, :]
            sdpa_ms = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True))
            t.row("decode_attention", f"B={b} ctx={ctx} H={h}/{hkv} D={d}", ms, nbytes, ref_ms, sdpa_ms)
            del k_cache, v_cache, kd, vd
            torch.cuda.empty_cache()


def bench_extend(t, args, ops):
    h, hkv, d, dt = args.heads, args.kv_heads, args.head_dim, torch.bfloat16
    for b, n, prefix in EXTEND_CASES[args.quick]:
        k_cache, v_cache, bt = paged_pool([prefix + n] * b, hkv, d, dt)
        q = torch.randn(b * n, h, d, device=DEVICE, dtype=dt)
        cu = torch.arange(b + 1, device=DEVICE, dtype=torch.int32) * n
        seq_lens = torch.full((b,), prefix + n, dtype=torch.int32, device=DEVICE)
        scale = d**-0.5
        ms = bench(lambda: ops.paged_extend_attention(q, k_cache, v_cache, bt, cu, seq_lens, scale))
        flops = 4 * b * h * d * (n * prefix + n * (n + 1) / 2)
        nbytes = 2 * k_cache.numel() * k_cache.element_size() + 2 * q.numel() * q.element_size()
        ref_ms = None
        if 3 * h * n * (prefix + n) * 4 <= REF_LIMIT_BYTES:  # scores, mask, probabilities of one sequence
            ref_ms = bench(lambda: extend_attention.paged_extend_attention_ref(q, k_cache, v_cache, bt, cu, seq_lens,
                                                                               scale))  # fmt: skip
        sdpa_ms = None
        if prefix == 0:  # dense causal baseline
            qd = q.view(b, n, h, d).transpose(1, 2)
            kd = k_cache.view(b, -1, hkv, d)[:, :n].transpose(1, 2).contiguous()
            vd = v_cache.view(b, -1, hkv, d)[:, :n].transpose(1, 2).contiguous()
            sdpa_ms = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale,
                                                                   enable_gqa=True))  # fmt: skip
        t.row("extend_attention", f"B={b} new={n} prefix={prefix}", ms, nbytes, ref_ms, sdpa_ms,
              f"{flops / ms / 1e9:.0f} TFLOP/s")  # fmt: skip
        del k_cache, v_cache
        torch.cuda.empty_cache()


def bench_tree(t, args, ops):
    h, hkv, d, dt = args.heads, args.kv_heads, args.head_dim, torch.bfloat16
    n = TREE_DRAFTS
    for b in TREE_BATCHES[args.quick]:
        for ctx in TREE_CONTEXTS[args.quick]:
            k_cache, v_cache, bt = paged_pool([ctx + n] * b, hkv, d, dt)
            q = torch.randn(b * n, h, d, device=DEVICE, dtype=dt)
            cu = torch.arange(b + 1, device=DEVICE, dtype=torch.int32) * n
            prefix = torch.full((b,), ctx, dtype=torch.int32, device=DEVICE)
            mask = torch.tril(torch.ones(n, n, dtype=torch.bool, device=DEVICE)).repeat(b, 1)
            scale = d**-0.5
            ms = bench(lambda: ops.paged_tree_attention(q, k_cache, v_cache, bt, cu, prefix, mask, scale))
            nbytes = 2 * k_cache.numel() * k_cache.element_size() + 2 * q.numel() * q.element_size()
            ref_ms = None
            if b <= 8 and ctx <= 4096:
                ref_ms = bench(lambda: tree_attention.paged_tree_attention_ref(q, k_cache, v_cache, bt, cu, prefix,
                                                                               mask, scale))  # fmt: skip
            t.row("tree_attention", f"B={b} ctx={ctx} drafts={n}", ms, nbytes, ref_ms)
            del k_cache, v_cache
            torch.cuda.empty_cache()


def bench_elementwise(t, args, ops):
    dt = torch.bfloat16
    hidden, inter = HIDDEN, INTERMEDIATE
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    cache = rotary.build_cos_sin_cache(1.0 / 500000 ** (torch.arange(0, d, 2, device=DEVICE).float() / d), 65536)
    for n in ELEMENTWISE_TOKENS[args.quick]:
        x = torch.randn(n, hidden, device=DEVICE, dtype=dt)
        r = torch.randn_like(x)
        w = torch.randn(hidden, device=DEVICE, dtype=dt)
        e = x.element_size()
        t.row("rms_norm", f"T={n} N={hidden}", bench(lambda: ops.rms_norm(x, w, 1e-5)), 2 * x.numel() * e,
              bench(lambda: rmsnorm.rms_norm_ref(x, w, 1e-5)))  # fmt: skip
        t.row("fused_add_rms_norm", f"T={n} N={hidden}", bench(lambda: ops.fused_add_rms_norm(x, r, w, 1e-5)),
              4 * x.numel() * e, bench(lambda: rmsnorm.fused_add_rms_norm_ref(x, r, w, 1e-5)))  # fmt: skip
        gu = torch.randn(n, 2 * inter, device=DEVICE, dtype=dt)
        t.row("silu_and_mul", f"T={n} I={inter}", bench(lambda: ops.silu_and_mul(gu)), gu.numel() * e * 3 // 2,
              bench(lambda: swiglu.silu_and_mul_ref(gu)))  # fmt: skip
        q = torch.randn(n, h, d, device=DEVICE, dtype=dt)
        k = torch.randn(n, hkv, d, device=DEVICE, dtype=dt)
        pos = torch.randint(0, 65536, (n,), device=DEVICE)
        t.row("apply_rotary", f"T={n} H={h}/{hkv} D={d}", bench(lambda: ops.apply_rotary(q, k, pos, cache)),
              2 * (q.numel() + k.numel()) * e + n * d * 4,
              bench(lambda: rotary.apply_rotary_ref(q, k, pos, cache)))  # fmt: skip
        k_cache = torch.zeros(-(-n // 16) + 1, 16, hkv, d, device=DEVICE, dtype=dt)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(k_cache.shape[0] * 16, device=DEVICE)[:n]
        t.row("store_kvcache", f"T={n} Hkv={hkv} D={d}",
              bench(lambda: ops.store_kvcache(k, k, k_cache, v_cache, slots)), 4 * k.numel() * e,
              bench(lambda: store_kv.store_kvcache_ref(k, k, k_cache, v_cache, slots)))  # fmt: skip


def bench_sampling(t, args, ops):
    for vocab in VOCABS:
        for b in SAMPLING_BATCHES[args.quick]:
            logits = torch.randn(b, vocab, device=DEVICE) * 3
            seeds = torch.arange(b, device=DEVICE)
            pos = torch.full((b,), 100, device=DEVICE)
            for label, temp, top_k, top_p in [("greedy", 0.0, 0, 1.0), ("T=1", 1.0, 0, 1.0),
                                              ("T=0.7 k=50 p=0.9", 0.7, 50, 0.9)]:  # fmt: skip
                tt = torch.full((b,), temp, device=DEVICE)
                kk = torch.full((b,), top_k, dtype=torch.int32, device=DEVICE)
                pp = torch.full((b,), top_p, device=DEVICE)
                ms = bench(lambda: ops.sample(logits, tt, kk, pp, seeds, pos))
                ref_ms = bench(lambda: sampling.sample_ref(logits, tt, kk, pp, seeds, pos))
                t.row("sample", f"B={b} V={vocab} {label}", ms, logits.numel() * 4, ref_ms,
                      extra="(GB/s of one logits read)")  # fmt: skip


SECTIONS = {
    "decode": bench_decode,
    "extend": bench_extend,
    "tree": bench_tree,
    "elementwise": bench_elementwise,
    "sampling": bench_sampling,
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {list(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/kernels.py measures GPU kernels and needs a CUDA device; none is visible here. "
                 "(Correctness on CPU: `make test` runs the kernels under TRITON_INTERPRET=1.)")  # fmt: skip
    import triton

    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        sys.exit(f"bench/kernels.py: unknown section(s) {sorted(unknown)}; choose from {list(SECTIONS)}")
    ops = kernels.ops(DEVICE)
    copy = copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"# measured device-to-device copy bandwidth: {copy:.0f} GB/s (1 GiB copy, read + write)")
    table = Table(copy)
    for name in args.only.split(","):
        SECTIONS[name](table, args, ops)


if __name__ == "__main__":
    main()
