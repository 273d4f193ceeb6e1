"""Rotary embedding (rotate-half, in place) against its reference and the HF formula."""

import math

import pytest
import torch

from kernels.rotary import apply_rotary_ref, build_cos_sin_cache
from tests.kernels.pool import DEVICES, DTYPES, assert_close, triton_ops


def llama3_inv_freq(head_dim, theta=500000.0, factor=8.0, low=1.0, high=4.0, orig=8192):
    """Llama-3 frequency scaling, as a caller would build it."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    wavelen = 2 * math.pi / inv
    smooth = (orig / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > orig / low, inv / factor, inv)
    mid = (wavelen <= orig / low) & (wavelen >= orig / high)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)


def test_reference_is_rotate_half():
    d = 16
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
    cache = build_cos_sin_cache(inv, 50)
    q, k, pos = torch.randn(4, 3, d), torch.randn(4, 1, d), torch.tensor([0, 1, 17, 49])
    q0, k0 = q.clone(), k.clone()
    apply_rotary_ref(q, k, pos, cache)
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]

    def rot(x):
        return torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)

    torch.testing.assert_close(q, q0 * cos + rot(q0) * sin)
    torch.testing.assert_close(k, k0 * cos + rot(k0) * sin)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 1, 48)])
def test_matches_reference(device, dtype, heads, kv_heads, head_dim):
    t = 13
    cache = build_cos_sin_cache(llama3_inv_freq(head_dim), 4096).to(device)
    # q and k as views into one fused qkv projection output, as the model has them
    qkv = torch.randn(t, heads + 2 * kv_heads, head_dim, device=device).to(dtype)
    q, k = qkv[:, :heads], qkv[:, heads : heads + kv_heads]
    pos = torch.randint(0, 4096, (t,), device=device)
    q_ref, k_ref = q.clone(), k.clone()
    v_before = qkv[:, heads + kv_heads :].clone()
    out = triton_ops(device).apply_rotary(q, k, pos, cache)
    apply_rotary_ref(q_ref, k_ref, pos, cache)
    assert out[0] is q and out[1] is k
    assert_close(q, q_ref, dtype)
    assert_close(k, k_ref, dtype)
    assert torch.equal(qkv[:, heads + kv_heads :], v_before)  # v untouched
