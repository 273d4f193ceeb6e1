"""The C++ CPU kernels against their PyTorch references on fresh random inputs:
block-quantized matmul (kernels/qgemm_cpu.py) and the decode step's small ops
(kernels/cpu_ops.py). Skipped where they cannot build (no compiler, no VNNI)."""

import pytest
import torch

import kernels
from kernels import cpu_ops, qgemm_cpu

needs_qgemm = pytest.mark.usefixtures("qgemm_built")
needs_ops = pytest.mark.usefixtures("cpu_ops_built")


def random_weight(g, N, K, bits):
    """Codes, fp16-valued scales and offsets (symmetric for 8 bits, as Q8_0)."""
    qs = torch.randint(0, 256, (N, K * bits // 8), dtype=torch.uint8, generator=g)
    d = (torch.rand(N, K // 32, generator=g) * 0.01).half().float()
    m = (torch.randn(N, K // 32, generator=g) * 0.01).half().float() if bits == 4 else -128 * d
    return qs, d, m


@needs_qgemm
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("M,K,N", [(1, 576, 960), (2, 64, 48), (3, 1536, 576), (5, 64, 16), (9, 128, 208),
                                   (37, 576, 3072)])
def test_qgemm_matches_reference(bits, M, K, N):
    """N = 48, 208: a partial last supertile (3 and 1 tiles); M covers every row tiling."""
    g = torch.Generator().manual_seed(M * K + N)
    x = torch.randn(M, K, generator=g) * 3
    qs, d, m = random_weight(g, N, K, bits)
    ref = qgemm_cpu.qgemm_ref(x, qs, d, m, bits)
    out = qgemm_cpu.qgemm_cpu(x, qgemm_cpu.pack(qs, d, m, bits), N, bits)
    # Same integer codes on both sides: only the fp32 summation order differs.
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


def test_pack_refuses_what_the_kernel_cannot_read():
    g = torch.Generator().manual_seed(1)
    qs, d, m = random_weight(g, 32, 64, 4)
    with pytest.raises(ValueError, match="fp16"):
        qgemm_cpu.pack(qs, d + 1e-7, m, 4)
    with pytest.raises(ValueError, match="symmetric"):
        qgemm_cpu.pack(torch.zeros(32, 64, dtype=torch.uint8), d, m, 8)
    with pytest.raises(ValueError, match="rows % 16"):
        qgemm_cpu.pack(qs[:8], d[:8], m[:8], 4)


def test_qgemm_reference_is_the_dequantized_matmul_up_to_activation_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 256, generator=g)
    qs = torch.randint(0, 256, (32, 128), dtype=torch.uint8, generator=g)
    d, m = torch.rand(32, 8, generator=g) * 0.1, -torch.rand(32, 8, generator=g)
    w = qgemm_cpu.unpack_codes(qs, 4).float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    exact = x @ w.T
    # wide (int16) activations per block of 32: relative error ~ 1/65278 per element
    err = (qgemm_cpu.qgemm_ref(x, qs, d, m, 4) - exact).abs().max() / exact.abs().max()
    assert 0 < err < 1e-4
    # narrow (int8 per 32 columns): each code off by at most half a step, amax / 254
    narrow = torch.tensor([True, False, True, False])
    got = qgemm_cpu.qgemm_ref(x, qs, d, m, 4, narrow)
    err8 = (got - exact).abs().amax(1) / exact.abs().max()
    assert 1e-4 < err8[0] < 1e-2 and 1e-4 < err8[2] < 1e-2
    assert torch.equal(got[1::2], qgemm_cpu.qgemm_ref(x, qs, d, m, 4)[1::2])


@needs_qgemm
@pytest.mark.parametrize("bits", [4, 8])
def test_qgemm_narrow_rows_match_reference_in_any_mix(bits):
    """Runs of wide and narrow rows of every length the kernel tiles (1-6, and 6 + 6 + 1), in one call."""
    g = torch.Generator().manual_seed(bits)
    kinds = [0, 1, 1, 0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 1, 1, 1, 0] + [1] * 13 + [0] + [1] * 6
    narrow = torch.tensor(kinds, dtype=torch.bool)
    x = torch.randn(len(kinds), 576, generator=g) * 3
    x[:, 7] *= 40  # an outlier column: the narrow rows' blocks that hold it lose precision, the wide ones not
    qs, d, m = random_weight(g, 208, 576, bits)
    packed = qgemm_cpu.pack(qs, d, m, bits)
    ref = qgemm_cpu.qgemm_ref(x, qs, d, m, bits, narrow)
    out = qgemm_cpu.qgemm_cpu(x, packed, 208, bits, narrow)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
    wide = qgemm_cpu.qgemm_cpu(x, packed, 208, bits)
    assert torch.equal(out[~narrow], wide[~narrow])
    assert not torch.allclose(out[narrow], wide[narrow], rtol=0, atol=1e-4 * ref.abs().max().item())
    for i in range(len(kinds)):  # a row's result depends on its own kind only
        assert torch.equal(out[i:i + 1], qgemm_cpu.qgemm_cpu(x[i:i + 1], packed, 208, bits, narrow[i:i + 1]))


@needs_ops
def test_cpu_ops_match_references():
    c, r = kernels.ops("cpu", impl="cpu"), kernels.ops("cpu", impl="ref")
    g = torch.Generator().manual_seed(1)
    x, res, w = torch.randn(3, 576, generator=g), torch.randn(3, 576, generator=g), torch.rand(576, generator=g)
    torch.testing.assert_close(c.rms_norm(x, w, 1e-5), r.rms_norm(x, w, 1e-5))
    for a, b in zip(c.fused_add_rms_norm(x, res, w, 1e-5), r.fused_add_rms_norm(x, res, w, 1e-5)):
        torch.testing.assert_close(a, b)
    gate_up = torch.randn(3, 3072, generator=g)
    torch.testing.assert_close(c.silu_and_mul(gate_up), r.silu_and_mul(gate_up))
    # rotary in place on strided views of a fused qkv row, as the model calls it
    qkv = torch.randn(3, 960, generator=g)
    views = []
    for _ in range(2):
        q, k, _ = qkv.clone().split([576, 192, 192], -1)
        views.append((q.reshape(3, 9, 64), k.reshape(3, 3, 64)))
    cs, pos = torch.randn(100, 64, generator=g), torch.tensor([5, 7, 99])
    c.apply_rotary(*views[0], pos, cs)
    r.apply_rotary(*views[1], pos, cs)
    torch.testing.assert_close(views[0], views[1])
    # KV store with a padding slot (-1), then paged decode attention over ragged lengths
    caches = [(torch.full((20, 16, 3, 64), float("nan")), torch.full((20, 16, 3, 64), float("nan"))) for _ in range(2)]
    k, v = torch.randn(320, 3, 64, generator=g), torch.randn(320, 3, 64, generator=g)
    slots = torch.randperm(320, generator=g)
    slots[3] = -1
    c.store_kvcache(k, v, *caches[0], slots)
    r.store_kvcache(k, v, *caches[1], slots)
    torch.testing.assert_close(caches[0], caches[1], equal_nan=True)
    kc, vc = caches[0][0].nan_to_num(0.0), caches[0][1].nan_to_num(0.0)
    q = torch.randn(4, 9, 64, generator=g)
    tables = torch.randint(0, 20, (4, 7), dtype=torch.int32, generator=g)
    lens = torch.tensor([1, 17, 100, 0], dtype=torch.int32)  # 0: a padding row gets zeros
    torch.testing.assert_close(c.paged_decode_attention(q, kc, vc, tables, lens, 0.125),
                               r.paged_decode_attention(q, kc, vc, tables, lens, 0.125))


@needs_qgemm
def test_qgemm_row_does_not_depend_on_its_batch():
    """Seeded sampling must not depend on batch composition: each row bit-for-bit alone."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(11, 576, generator=g)
    for bits in (4, 8):
        qs, d, m = random_weight(g, 96, 576, bits)
        packed = qgemm_cpu.pack(qs, d, m, bits)
        full = qgemm_cpu.qgemm_cpu(x, packed, 96, bits)
        assert all(torch.equal(full[i:i + 1], qgemm_cpu.qgemm_cpu(x[i:i + 1], packed, 96, bits)) for i in range(11))
