"""The C++ step's two attention kernels for prompt rows (kernels/cpu_forward.py
`prompt_attention`): the one-token kernel every row but a prompt's narrow rows runs, and
the blocked kernel those rows run (tokens in blocks over each key once), against a dense
fp64 causal softmax, over every pool dtype, head size and grouping, across the 256-key
chunk edge (the blocked kernel within bf16's rounding where the CPU has AVX512_BF16); and a
blocked row's result the same bit for bit whatever block it shares."""

import pytest
import torch

from kernels import cpu_forward
from kernels.paged import dequantize_kv_ref, quantize_kv_ref
from tests.kernels.pool import make_pool

pytestmark = pytest.mark.usefixtures("cpu_forward_built")  # built when a test runs, never while collecting


def pool(n_keys, kv_heads, head_dim, dtype, seed=0):
    """(k, v as the step's pool stores them, their fp64 values, the sequence's table)."""
    k, v, tables = make_pool([n_keys], kv_heads, head_dim, 16, torch.float32, "cpu", seed=seed)
    if dtype == torch.int8:
        k, v = quantize_kv_ref(k), quantize_kv_ref(v)
    else:
        k, v = k.to(dtype), v.to(dtype)
    table = tables[0, : -(-n_keys // 16)].contiguous()
    return k, v, dequantize_kv_ref(k).double(), dequantize_kv_ref(v).double(), table


def reference(q, kd, vd, table, plain0):
    """Token i over keys [0, plain0 + i): softmax(q k^T / sqrt(D)) v in fp64."""
    nq, H, D = q.shape
    G = H // kd.shape[2]
    n = plain0 + nq - 1
    keys = kd[table.long()].flatten(0, 1)[:n].repeat_interleave(G, 1)  # (n, H, D)
    vals = vd[table.long()].flatten(0, 1)[:n].repeat_interleave(G, 1)
    s = torch.einsum("ihd,jhd->hij", q.double(), keys) / D**0.5  # (H, nq, n)
    causal = torch.arange(n)[None, :] < (plain0 + torch.arange(nq))[:, None]  # token i sees plain0 + i keys
    p = torch.softmax(s.masked_fill(~causal, float("-inf")), -1)
    return torch.einsum("hij,jhd->ihd", p, vals)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 16), (8, 2, 128), (6, 1, 32)])
@pytest.mark.parametrize("plain0,nq", [(1, 40), (230, 60), (500, 30)])  # whole prompts, across chunk edges
def test_both_kernels_match_a_dense_softmax(dtype, heads, kv_heads, head_dim, plain0, nq):
    k, v, kd, vd, table = pool(plain0 + nq, kv_heads, head_dim, dtype)
    q = torch.randn(nq, heads, head_dim, generator=torch.Generator().manual_seed(1))
    ref = reference(q, kd, vd, table, plain0)
    scale = max(1.0, ref.abs().max().item())
    for blocked in (False, True):
        out = cpu_forward.prompt_attention(q, k, v, table, plain0, blocked)
        assert out.shape == ref.shape and torch.isfinite(out).all()
        err = (out.double() - ref).abs()
        if blocked and cpu_forward.block_bf16():  # q, k, e and v rounded to bf16 (8 bits): ~1e-2 at most, ~5e-4 mean
            assert err.max().item() < 3e-2 * scale and err.mean().item() < 2e-3 * scale, (err.max(), err.mean())
        else:
            assert err.max().item() < 2e-5 * scale, (blocked, err.max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8])
def test_a_blocked_rows_result_does_not_depend_on_its_block(dtype):
    """Rows 37.. of a 90-token call against the same rows called alone, from row 37 on and
    one at a time: other block boundaries, other lane positions, other block sizes."""
    plain0, nq = 200, 90
    k, v, _, _, table = pool(plain0 + nq, 3, 64, dtype, seed=2)
    q = torch.randn(nq, 9, 64, generator=torch.Generator().manual_seed(3))
    whole = cpu_forward.prompt_attention(q, k, v, table, plain0, True)
    tail = cpu_forward.prompt_attention(q[37:], k, v, table, plain0 + 37, True)
    assert torch.equal(whole[37:], tail)
    for i in (0, 37, 55, 56, 89):  # 56: the first key of the second chunk is its last
        assert torch.equal(cpu_forward.prompt_attention(q[i : i + 1], k, v, table, plain0 + i, True)[0], whole[i])
    one = cpu_forward.prompt_attention(q, k, v, table, plain0, False)
    assert not torch.equal(one, whole)  # the other kernel: the same values, summed in another order
