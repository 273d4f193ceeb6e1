"""kernels.ops(..., fused_decode=True): rotary + KV store in one kernel (kernels/rope_store.py)
and decode attention with its merge folded in (kernels/decode_attention.py), each against its
reference; and a tiny model's greedy tokens the same with the switch on and off."""

import pytest
import torch

import kernels
from kernels.decode_attention import FusedDecodeAttention, _decode_fused, paged_decode_attention_ref
from kernels.rope_store import rope_store_ref
from kernels.rotary import apply_rotary_ref, build_cos_sin_cache
from kernels.store_kv import store_kvcache_ref
from tests.kernels.pool import ATTENTION_TOL, DEVICES, ELEMENTWISE_TOL, assert_close, make_pool, needs_gpu

DTYPES = [torch.float32, torch.bfloat16]
# Block size 16 and the kernel's 64-key tile: lengths at, below and across both.
LENS = [1, 15, 17, 64, 65, 130]


def fused_ops(device):
    return kernels.ops(device, impl="triton", fused_decode=True)


def _inputs(t, heads, kv_heads, head_dim, block_size, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    inv = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    cache = build_cos_sin_cache(inv, 1024).to(device)
    # q, k and v as views into one fused qkv projection output, as the model has them
    qkv = torch.randn(t, heads + 2 * kv_heads, head_dim, generator=g).to(dtype).to(device)
    pos = torch.randint(0, 1024, (t,), generator=g).to(device)
    shape = (8, block_size, kv_heads, head_dim)
    pool = torch.full((2, *shape), float("nan"), dtype=dtype, device=device)  # poison: untouched slots stay NaN
    slots = torch.randperm(8 * block_size, generator=g)[:t]
    slots[1::4] = -1  # not stored (CUDA-graph padding)
    return qkv, pos, cache, pool, slots.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 4, 64, 16), (9, 3, 64, 5), (8, 1, 128, 16),
                                                                 (6, 2, 128, 1)])
def test_rope_store_matches_reference(device, dtype, heads, kv_heads, head_dim, block_size):
    t = 7
    qkv, pos, cache, pool, slots = _inputs(t, heads, kv_heads, head_dim, block_size, dtype, device)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    qkv_ref, pool_ref = qkv.clone(), pool.clone()
    q_ref, k_ref, v_ref = qkv_ref[:, :heads], qkv_ref[:, heads : heads + kv_heads], qkv_ref[:, heads + kv_heads :]
    out = fused_ops(device).rope_store(q, k, v, pos, cache, pool[0], pool[1], slots)
    assert rope_store_ref(q_ref, k_ref, v_ref, pos, cache, pool_ref[0], pool_ref[1], slots) is q_ref
    assert out is q
    assert_close(q, q_ref, dtype)
    assert torch.equal(qkv[:, heads:], qkv_ref[:, heads:])  # k and v themselves untouched
    written = torch.zeros(pool.shape[1] * block_size, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    for got, want in zip(pool, pool_ref):
        rows, rows_ref = got.reshape(len(written), -1).cpu(), want.reshape(len(written), -1).cpu()
        assert torch.isnan(rows[~written]).all() and torch.isnan(rows_ref[~written]).all()
        atol, rtol = ELEMENTWISE_TOL[dtype]
        torch.testing.assert_close(rows[written].float(), rows_ref[written].float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(pool[1].cpu(), pool_ref[1].cpu(), atol=0, rtol=0, equal_nan=True)  # v: a copy


def test_the_reference_is_rotary_then_store():
    qkv, pos, cache, pool, slots = _inputs(5, 6, 2, 16, 4, torch.float32, "cpu")
    q, k, v = qkv[:, :6].clone(), qkv[:, 6:8].clone(), qkv[:, 8:].clone()
    pool2 = pool.clone()
    rope_store_ref(q, k, v, pos, cache, pool[0], pool[1], slots)
    q2, k2 = apply_rotary_ref(qkv[:, :6].clone(), qkv[:, 6:8].clone(), pos, cache)
    store_kvcache_ref(k2, v, pool2[0], pool2[1], slots)
    assert torch.equal(q, q2) and torch.equal(k, qkv[:, 6:8])
    torch.testing.assert_close(pool, pool2, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_int8_pools_are_refused(device):
    qkv, pos, cache, _, slots = _inputs(3, 4, 2, 16, 4, torch.float32, device)
    pool = torch.zeros(2, 4, 4, 2, 20, dtype=torch.int8, device=device)
    with pytest.raises(ValueError, match="int8"):
        fused_ops(device).rope_store(qkv[:, :4], qkv[:, 4:6], qkv[:, 6:], pos, cache, pool[0], pool[1], slots)
    q = torch.randn(1, 4, 16, device=device)
    table = torch.zeros(1, 1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="int8"):
        fused_ops(device).paged_decode_attention(q, pool[0], pool[1], table, torch.ones(1, dtype=torch.int32,
                                                                                         device=device), 0.25)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 1, 128)])  # GQA 1, 3, 8
def test_fused_decode_matches_reference(device, dtype, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    k_cache, v_cache, block_tables = make_pool(LENS, kv_heads, head_dim, 16, dtype, device)
    q = torch.randn(len(LENS), heads, head_dim, device=device).to(dtype)
    seq_lens = torch.tensor(LENS, dtype=torch.int32, device=device)
    attend = fused_ops(device).paged_decode_attention
    assert isinstance(attend, FusedDecodeAttention)
    out = attend(q, k_cache, v_cache, block_tables, seq_lens, 0.125)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, 0.125)
    assert_close(out, ref, dtype, ATTENTION_TOL)
    assert (attend.counters(q.device, 1) == 0).all()  # every row's counter back to 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block_size", [16, 5])
def test_fused_merge_at_every_split_count(device, block_size):
    """One split (written directly), and more splits than a short sequence has tiles (empty
    splits: weight 0); graph-padding rows (seq_len 0) get zeros; one counter buffer across
    launches of different split counts, zero after each."""
    lens = [3, 0, 64, 200]
    k_cache, v_cache, block_tables = make_pool([max(n, 1) for n in lens], 2, 32, block_size, torch.float32, device)
    q = torch.randn(4, 6, 32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, 0.2)
    counters = torch.zeros(16, dtype=torch.int32, device=device)
    for num_splits in (1, 2, 7, 3):
        out = _decode_fused(q, k_cache, v_cache, block_tables, seq_lens, 0.2, num_splits, counters)
        assert_close(out, ref, torch.float32, ATTENTION_TOL)
        assert (out[1] == 0).all() and (counters == 0).all()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch,context", [(1, 32768), (4, 4096), (80, 1024)])  # many splits .. one
def test_fused_decode_long_context_gpu(batch, context):
    """On the device the last program of a row reads the other programs' partials: the
    atomic's acquire/release must make them visible (the interpreter runs programs in turn)."""
    lens = [context - 7 * i for i in range(batch)]
    k_cache, v_cache, block_tables = make_pool(lens, 8, 128, 16, torch.bfloat16, "cuda")
    q = torch.randn(batch, 32, 128, device="cuda").bfloat16()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    attend = fused_ops("cuda").paged_decode_attention
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, 128**-0.5)
    for _ in range(3):
        assert_close(attend(q, k_cache, v_cache, block_tables, seq_lens, 128**-0.5), ref, torch.bfloat16,
                     ATTENTION_TOL)


@pytest.mark.gpu
@needs_gpu
def test_fused_decode_in_a_cuda_graph():
    """Counters zeroed once (the eager warm-up), zero again after every replay."""
    lens = [2000, 37, 500]
    k_cache, v_cache, block_tables = make_pool(lens, 8, 128, 16, torch.bfloat16, "cuda")
    q = torch.randn(3, 32, 128, device="cuda").bfloat16()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    attend = fused_ops("cuda").paged_decode_attention
    attend(q, k_cache, v_cache, block_tables, seq_lens, 0.1)  # warm-up: compiles, allocates the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attend(q, k_cache, v_cache, block_tables, seq_lens, 0.1)
    for i in range(5):
        q.copy_(torch.randn_like(q))
        graph.replay()
        ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, 0.1)
        assert_close(out, ref, torch.bfloat16, ATTENTION_TOL)
        assert (attend.counters(q.device, 1) == 0).all()


def test_the_switch():
    plain, fused = kernels.ops("cpu", impl="ref"), kernels.ops("cpu", impl="ref", fused_decode=True)
    assert plain.rope_store is None and not plain.fused_decode and kernels.ops("cuda").rope_store is None
    assert fused.rope_store is rope_store_ref and fused.paged_decode_attention is plain.paged_decode_attention
    cuda = kernels.ops("cuda", fused_decode=True)  # choosing needs no device
    assert cuda.rope_store.__name__ == "rope_store_triton" and isinstance(cuda.paged_decode_attention,
                                                                           FusedDecodeAttention)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tokens_are_the_same_with_the_switch_on(device):
    """A tiny model through the engine on the Triton kernels (the interpreter on CPU), graph
    buffers as a replay uses them: the switch changes launches, not tokens."""
    from replica.config import EngineConfig
    from replica.engine.llm_engine import LLMEngine
    from tests.replica.engines import prompts, run
    from tests.replica.tiny import tiny_config, tiny_weights
    from wire import protocol as P

    cfg = tiny_config()  # GQA 3:1, head_dim 8
    w = tiny_weights(cfg)
    sp = P.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    tokens = []
    for fused in (False, True):
        ecfg = EngineConfig(device=device, graph_mode="buffers", num_blocks=16, block_size=16, max_num_seqs=4,
                            max_num_batched_tokens=64, speculative="off")
        engine = LLMEngine(ecfg, cfg, w, ops=kernels.ops(device, impl="triton", fused_decode=fused))
        for rid, ids in prompts([9, 21, 3], seed=1).items():
            assert engine.add(P.Generate(id=rid, prompt_ids=ids, sampling=sp)) is None
        tokens.append(run(engine)[0])
        if fused:  # the decode steps went through the one-launch attention
            assert torch.device(device) in engine.runner.ops.paged_decode_attention._counters
        engine.close()
    assert tokens[0] == tokens[1] and all(len(t) == 5 for t in tokens[0].values())
