"""The whole-step C++ decoder (kernels/cpu_forward.py through replica/model/cpu_model.py)
against the op-by-op LlamaModel over the same packed QLinears, on a small random
model whose shapes exercise partial supertiles, GQA and a qkv bias: prefill
chunks over a cached prefix, a mixed decode + prefill step, a draft-tree verify
step, EAGLE-3 features, a padding row, contexts of several attention chunks; and a
row's logits bit for bit alone or batched. The reference reads a KV pool of the
step's dtype (fp16 by default, fp32 or int8 on request). Tolerance: 3e-4 of the values'
scale. Only fp32 summation orders differ, but an input that moves in its last bit
can round an int16 activation code (or a stored fp16 key, or an int8 code) the other
way; the op-by-op model with the PyTorch reference ops differs from itself with the
C++ ops by the same 1e-4."""

import time

import pytest
import torch

import kernels
from replica.config import EngineConfig
from kernels.paged import dequantize_kv_ref, quantize_kv_ref
from replica.model.cpu_model import CpuModel
from replica.model.llama import LlamaModel
from replica.model.plan import Sampling, StepPlan
from replica.model.runner import Runner, build_model, kv_bytes_per_block
from tests.replica.tiny import tiny_config, tiny_weights

pytestmark = pytest.mark.usefixtures("cpu_forward_built")

GREEDY = Sampling(temperature=0.0, top_k=0, top_p=1.0, seed=0, position=0)


KV_DTYPES = [torch.float16, torch.float32, torch.int8]
# Of the values' scale. A key or value that the two paths compute a few fp32 ulps apart can
# round to fp16 ulps apart (2^-11 of it): with an fp16 pool the outputs move ~3x more. In
# int8 such a value can round to the next code (1/127 of its row's largest): both paths
# quantize by the same formula, yet 20-40 of a step's 37k stored codes flipped, and the
# outputs moved by up to 2.5e-3 (the long-context test's by 4e-4).
TOL = {torch.float32: 3e-4, torch.float16: 1e-3, torch.int8: 4e-3}


def fill_noise(kv: torch.Tensor, seed: int = 5):
    """Random keys and values in every slot, stored as the pool's dtype stores them."""
    g = torch.Generator().manual_seed(seed)
    if kv.dtype != torch.int8:
        return kv.normal_(generator=g)
    kv.copy_(quantize_kv_ref(torch.randn(*kv.shape[:-1], kv.shape[-1] - 4, generator=g)))


def runners(bias: bool, aux=(), kv=torch.float16, num_blocks=12, **shape):
    """(the C++ step, the op-by-op reference reading a pool of the same dtype)."""
    cfg = tiny_config(**{**dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2,
                                num_layers=3, attention_bias=bias), **shape})
    w = tiny_weights(cfg, seed=3)
    out = []
    for mode in ("auto", "off"):  # auto on CPU: the C++ step; off: op by op
        r = Runner(EngineConfig(quantization="int4", graph_mode=mode, num_blocks=num_blocks, cpu_threads=2,
                                max_num_seqs=4, max_num_batched_tokens=64), cfg, w,
                   ops=kernels.ops("cpu", cpu_step_kv=kv))
        r.allocate_kv(aux_layers=aux, kv_dtype=out[0].kv_cache.dtype if out else None)
        fill_noise(r.kv_cache)  # stale pool contents must not matter
        out.append(r)
    assert isinstance(out[0].model, CpuModel) and not isinstance(out[1].model, CpuModel)
    assert out[0].kv_cache.dtype == out[1].kv_cache.dtype == kv
    return out


def plan(ids, starts, num_tokens, tables, sample_rows, num_decodes, trees=()):
    n_logits = sum(len(t) for t in trees) + len(sample_rows)
    return StepPlan(input_ids=ids, starts=starts, num_tokens=num_tokens, block_tables=tables, sample_rows=sample_rows,
                    num_decodes=num_decodes, sampling=[GREEDY] * n_logits, trees=[list(t) for t in trees])


def same(a: torch.Tensor, b: torch.Tensor, tol: float = 3e-4):
    """Within tol of b's scale; a stored fp16 value may also round the other way (one ulp, 2^-10 of it),
    an int8 one to the next code (its row's scale); int8 pools compare as their values."""
    half, codes = a.dtype == torch.float16, a.dtype == torch.int8
    if codes:
        ulp = 1.001 * b[..., -4:].contiguous().view(torch.float32)  # (..., 1) the row's scale
        assert (a[..., :-4] == b[..., :-4]).float().mean() > 0.99  # almost every code the same
    a, b = dequantize_kv_ref(a), dequantize_kv_ref(b)
    if half:
        ulp = 2.0**-10 * b.abs()
    elif not codes:
        ulp = 0.0
    excess = (a - b).abs() - ulp - tol * b.abs().max()
    assert excess.max().item() <= 0, excess.max().item()


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_step_matches_the_op_by_op_model(bias, kv):
    fast, ref = runners(bias, aux=(0, 2), kv=kv)
    g = torch.Generator().manual_seed(7)
    ids = lambda n: torch.randint(1, 96, (n,), generator=g).tolist()  # noqa: E731
    steps = [
        # prefill: A 20 tokens (two blocks), B 7 tokens
        plan(ids(27), [0, 0], [20, 7], [[0, 1], [2]], [0, 1], 0),
        # A decodes at 20 while B prefills 12 more tokens over its 7 cached ones
        plan(ids(13), [20, 7], [1, 12], [[0, 1], [2, 3]], [0, 1], 1),
        # A verifies a draft tree (root, two children, a grandchild) beside B's decode at 19
        plan(ids(5), [21, 19], [4, 1], [[0, 1], [2, 3]], [1], 1, trees=[[-1, 0, 0, 1]]),
    ]
    for p in steps:
        a, b = fast.execute(p), ref.execute(p)
        same(a.logits, b.logits, TOL[kv])
        same(a.aux, b.aux, TOL[kv])
        assert a.tokens.tolist() == b.tokens.tolist()
        same(fast.kv_cache, ref.kv_cache, TOL[kv])


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("hidden,heads,kv_heads", [(192, 3, 1), (128, 8, 1), (256, 2, 1), (320, 10, 2)])
def test_long_contexts_match_the_op_by_op_model(hidden, heads, kv_heads, kv):
    """Rows over several 256-key chunks of attention, with key counts that end mid-way
    through 16 keys: head_dim 64, 16, 128 and 32; 3, 8, 2 and 5 query heads per kv head
    (the C++ step takes them 4 at a time, 2 at head_dim 128). The keys before each row's
    own are the pool's noise, the same in both models, so the attention reads equal keys."""
    fast, ref = runners(False, kv=kv, num_blocks=90, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                        num_layers=2, max_position_embeddings=1024)
    tables = [list(range(0, 38)), list(range(38, 57)), list(range(57, 83))]
    # A decodes at 600 (3 chunks), B at 300; C's chunk of 5 tokens at 401..405 (2 chunks each)
    p = plan([5, 6, 7, 8, 9, 10, 11], [600, 300, 401], [1, 1, 5], tables, [0, 1, 2], 2)
    a, b = fast.execute(p), ref.execute(p)
    same(a.logits, b.logits, TOL[kv])
    same(fast.kv_cache, ref.kv_cache, TOL[kv])


def test_int8_rows_round_trip():
    """An int8 row is its codes round(x 127 / max|x|) and the fp32 scale max|x| / 127: every value
    comes back within half a code, the largest exactly, a row of zeros as zeros."""
    x = torch.randn(50, 3, 64, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 2, 50)[:, None, None]
    x[7, 1] = 0.0
    rows = quantize_kv_ref(x)
    assert rows.dtype == torch.int8 and rows.shape == (50, 3, 68)
    scale = rows[..., 64:].contiguous().view(torch.float32)
    assert torch.equal(scale, x.abs().amax(-1, keepdim=True) / 127)
    assert rows[..., :64].abs().max() == 127 and (rows[..., :64].abs().amax(-1) == 127).sum() == 149
    back = dequantize_kv_ref(rows)
    assert ((back - x).abs() <= scale / 2 * 1.0001).all()
    assert torch.equal(back[7, 1], torch.zeros(64))


def test_the_int8_step_reads_each_rows_scales():
    """Scales rewritten per row in both pools (keys and values, every layer): the step and the
    reference still agree; rewritten in the step's pool alone, they do not. A kernel reading a
    neighbour's scale, or none, fails the first; one ignoring scales, the second."""
    fast, ref = runners(False, kv=torch.int8, num_blocks=40, hidden_size=128, num_heads=4, num_kv_heads=2,
                        num_layers=2, max_position_embeddings=1024)
    factor = torch.rand(*fast.kv_cache.shape[:-1], 1, generator=torch.Generator().manual_seed(2)) * 1.5 + 0.5
    for r in (fast, ref):
        scales = r.kv_cache[..., -4:].contiguous().view(torch.float32)
        r.kv_cache[..., -4:] = (scales * factor).view(torch.int8)
    tables = [list(range(0, 20)), list(range(20, 40))]
    p = plan([5, 6], [300, 290], [1, 1], tables, [0, 1], 2)  # decodes over the rewritten rows, 2 chunks each
    a, b = fast.execute(p), ref.execute(p)
    same(a.logits, b.logits, TOL[torch.int8])
    fast.kv_cache[..., -4:] = (fast.kv_cache[..., -4:].contiguous().view(torch.float32) * factor).view(torch.int8)
    a, b = fast.execute(p), ref.execute(p)
    with pytest.raises(AssertionError):
        same(a.logits, b.logits, TOL[torch.int8])


def test_a_rows_logits_do_not_depend_on_its_batch():
    fast, _ = runners(False)
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(1, 96, (n,), generator=g).tolist() for n in (18, 5, 30, 9)]
    tables = [[0, 1], [2], [3, 4], [5]]
    fast.execute(plan(sum(prompts, []), [0] * 4, [len(p) for p in prompts], tables, [0, 1, 2, 3], 0))
    starts = [len(p) for p in prompts]
    together = fast.execute(plan([11, 12, 13, 14], starts, [1] * 4, tables, [0, 1, 2, 3], 4)).logits
    for i in range(4):  # each alone rewrites the same KV slot with the same values
        alone = fast.execute(plan([11 + i], [starts[i]], [1], [tables[i]], [0], 1)).logits
        assert torch.equal(alone[0], together[i])


def test_padding_rows_are_inert():
    """A decode row with slot -1 and length 0 (what padded batch buckets send) stores
    nothing and does not change the other rows."""
    fast, _ = runners(False)
    fast.execute(plan(list(range(1, 11)), [0], [10], [[0]], [0], 0))
    before = fast.kv_cache.clone()
    model, kv = fast.model, fast.kv_cache
    from replica.model.llama import Context

    ctx = lambda n: Context(slot_mapping=torch.tensor([10, -1][:n]), num_decode_tokens=n,  # noqa: E731
                            decode_block_tables=torch.tensor([[0], [0]][:n], dtype=torch.int32),
                            decode_seq_lens=torch.tensor([11, 0][:n], dtype=torch.int32), extend_block_tables=None,
                            extend_cu_seqlens_q=None, extend_seq_lens=None)
    two = model(torch.tensor([5, 9]), torch.tensor([10, 0]), ctx(2), kv)
    after = kv.clone()
    one = model(torch.tensor([5]), torch.tensor([10]), ctx(1), kv)
    assert torch.equal(two[0], one[0])
    changed = (after != before).flatten(2, 3).any(-1).any(-1)  # (layers, k/v, slots): which slots were written
    assert changed[:, :, 10].all() and changed.sum() == changed[:, :, 10].numel()


def test_the_result_does_not_depend_on_the_thread_count():
    """Chunks go to whichever thread claims them and a loaded machine runs steps on the
    caller alone (kernels/cpu_pool.py): every chunk's arithmetic is the same either way.
    A prompt step of 70 rows is also split into row blocks on more than one thread (a
    matmul of few supertiles), and on one thread not."""
    cfg = tiny_config(vocab_size=96, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, num_layers=3)
    w = tiny_weights(cfg, seed=4)
    outs = []
    for threads in (1, 2, 3):
        r = Runner(EngineConfig(quantization="int4", num_blocks=12, cpu_threads=threads, max_num_seqs=4,
                                max_num_batched_tokens=128), cfg, w)
        r.allocate_kv()
        assert r.model.decoder.threads() == threads
        tables = [[0, 1, 2, 3], [4, 5]]
        prompts = plan(list(range(1, 71)), [0, 0], [50, 20], tables, [0, 1], 0)
        outs.append((r.execute(prompts).logits, r.execute(plan([5, 6], [50, 20], [1, 1], tables, [0, 1], 2)).logits))
    assert all(torch.equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o))


def test_the_pool_goes_solo_only_when_one_thread_would_be_faster():
    """After a step on both threads the pool runs the next ones on the caller alone only where that is the
    faster way: the helpers barely worked, or the caller's own pace over all the chunks beats the step."""
    from kernels import cpu_forward

    ms = 1_000_000
    # the helper did 40 % of the chunks; the caller waited 30 % of the step on one it held: alone, the caller would
    # have taken 28 / 0.6 = 47 ms against 40
    assert not cpu_forward.solo_would_win(100, 40, 40 * ms, 12 * ms)
    # a helper descheduled with its chunk: the caller waited 25 of 40 ms, alone it needed 15 / 0.7 = 21
    assert cpu_forward.solo_would_win(100, 30, 40 * ms, 25 * ms)
    # the helpers took under a fifth of the chunks: their core is someone else's
    assert cpu_forward.solo_would_win(100, 19, 20 * ms, 0)
    # an even split without waiting: both threads
    assert not cpu_forward.solo_would_win(100, 50, 20 * ms, 0)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_runner_counts_the_pools_steps(threads):
    """Runner.pool_stats (the engine's Load, /metrics' cpu_steps_total and cpu_solo_steps_total): one step a forward,
    none for the logits; the solo ones among them, never on a pool of one thread (nothing to judge: a replica
    started with one thread is not short of cores)."""
    cfg = tiny_config(vocab_size=96, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, num_layers=2)
    r = Runner(EngineConfig(quantization="int4", num_blocks=8, cpu_threads=threads, max_num_seqs=4), cfg,
               tiny_weights(cfg, seed=3))
    r.allocate_kv()
    assert r.pool_stats() == (0, 0)
    r.execute(plan(list(range(1, 9)), [0], [8], [[0]], [0], 0))
    for n in range(2, 5):
        r.execute(plan([7], [n + 6], [1], [[0]], [0], 1))
    steps, solo = r.pool_stats()
    assert steps == 4 and 0 <= solo <= steps and (threads > 1 or solo == 0)


def test_the_kernel_set_decides_packing_and_the_cpu_step_once():
    """kernels.ops is the one place: forced to the references, the same quantized
    model is neither packed nor stepped in C++; by default (C++ built) it is both."""
    cfg = tiny_config(vocab_size=96, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, num_layers=2)
    ecfg = EngineConfig(quantization="int8", cpu_threads=1)
    ref_ops, cpu_ops = kernels.ops("cpu", impl="ref"), kernels.ops("cpu")
    assert (ref_ops.packed_qgemm, ref_ops.cpu_step) == (False, False)
    assert (cpu_ops.packed_qgemm, cpu_ops.cpu_step) == (True, True)
    ref = build_model(cfg, ecfg, tiny_weights(cfg), ref_ops, 64)
    assert isinstance(ref, LlamaModel) and ref.lm_head.packed is None
    assert all(layer.mlp.down_proj.packed is None for layer in ref.layers)
    assert isinstance(build_model(cfg, ecfg, tiny_weights(cfg), cpu_ops, 64), CpuModel)


@pytest.mark.parametrize("name,dtype,row", [("auto", torch.float16, 16), ("float32", torch.float32, 16),
                                            ("int8", torch.int8, 20)])
def test_the_engine_config_chooses_the_steps_pool(name, dtype, row):
    """EngineConfig.kv_cache_dtype (--kv-cache-dtype) picks the C++ step's pool; an int8 row is
    head_dim codes and a 4-byte scale, and the block accounting counts those bytes."""
    cfg = tiny_config(vocab_size=96, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, num_layers=2)
    r = Runner(EngineConfig(quantization="int4", kv_cache_dtype=name, kv_memory_bytes=1 << 20, cpu_threads=1), cfg,
               tiny_weights(cfg))
    r.allocate_kv()
    kv = r.kv_cache
    assert r.ops.cpu_step_kv == dtype and kv.dtype == dtype and kv.shape[-1] == row
    assert kv.numel() * kv.element_size() == kv.shape[2] * kv_bytes_per_block(cfg, r.block_size, dtype)
    assert kv.shape[2] == (1 << 20) // kv_bytes_per_block(cfg, r.block_size, dtype)


def test_phase_timing_adds_up_only_while_on():
    """Decoder.set_timing: off, a forward adds nothing; on, each forward counts as a step and its
    seven phases' times are non-negative and together no longer than the call."""
    fast, _ = runners(False)
    dec = fast.model.decoder
    step = plan(list(range(1, 21)), [0], [20], [[0, 1]], [0], 0)
    fast.execute(step)
    assert dec.phase_ms() == [0.0] * 8
    dec.set_timing(True)
    t0 = time.perf_counter()
    fast.execute(step)
    wall_ms = (time.perf_counter() - t0) * 1e3
    steps, *ms = dec.phase_ms()
    assert steps == 1 and len(ms) == 7 and min(ms) >= 0 and 0 < sum(ms) <= wall_ms
    dec.set_timing(False)
    assert dec.phase_ms() == [0.0] * 8


def activation_runners(w=None, kinds=("int16", "int8")):
    """C++-step runners of one tiny model, by `prefill_activations`."""
    cfg = tiny_config(vocab_size=96, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, num_layers=3)
    w = w or tiny_weights(cfg, seed=3)
    run = {}
    for acts in kinds:
        run[acts] = Runner(EngineConfig(quantization="int4", num_blocks=12, cpu_threads=2, max_num_seqs=4,
                                        max_num_batched_tokens=64), cfg, w,
                           ops=kernels.ops("cpu"))
        run[acts].allocate_kv()
        assert isinstance(run[acts].model, CpuModel)
    return run


def narrow_from(run, prompts=None):
    """Turn on the int8 runners' narrow rows (what the engine does at start), calibrated on
    `prompts` or, without them, with no outlier columns."""
    for acts, r in run.items():
        if not acts.startswith("int8"):
            continue
        if prompts:
            assert r.enable_narrow(0, lambda: prompts)
        else:
            r.narrow_from = 0


def test_int8_prefill_rounds_only_the_prompt_rows_that_sample_nothing():
    """`prefill_activations="int8"`: the KV a narrow row leaves moves by int8's rounding; a prompt's
    last token, and a resumed sequence's generated tokens, stay wide, so their layer-0 KV (which
    reads nothing but their own embedding) is bit for bit int16's, and the sampled logits move by
    no more than the narrow rows' KV moved them."""
    run = activation_runners()
    narrow_from(run)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(1, 96, (27,), generator=g).tolist()
    # A: a whole 20-token prompt, its last token sampled; B: 7 tokens, of which the last 3 are
    # generated tokens a resume computes again (prompt of 4: its last token stays wide too, as
    # when it sampled), not sampled (the chunk stops short)
    p = plan(ids, [0, 0], [20, 7], [[0, 1], [2]], [0], 0)
    p.prompt_lens = [20, 4]
    assert run["int16"].narrow_from is None and run["int8"].narrow_from == 0
    out = {acts: r.execute(p) for acts, r in run.items()}
    k0 = {acts: r.kv_cache[0, 0].flatten(0, 1).float() for acts, r in run.items()}  # layer 0's keys by slot
    slots = list(range(20)) + list(range(32, 39))
    moved = [not torch.equal(k0["int16"][s], k0["int8"][s]) for s in slots]
    assert moved == [True] * 19 + [False] + [True] * 3 + [False] * 4
    a, b = out["int8"].logits, out["int16"].logits
    assert 0 < (a - b).abs().max() < 0.1 * b.abs().max()


def test_int8_decodes_leave_the_kv_a_resume_leaves():
    """`decode_activations="int8"`: a decode row's matmul inputs are int8 (its layer-0 key, which
    reads nothing but its own embedding, moves from int16's), and a resume computing the generated
    tokens again rounds them the same way, the one it samples from too (a decode would have): their
    layer-0 keys are bit for bit the decodes' own, the prompt's too (int16 both times)."""
    run = activation_runners(kinds=("int16", "int8 decodes", "int8 resume"))
    for name in ("int8 decodes", "int8 resume"):
        run[name].narrow_from, run[name].narrow_decodes = None, True  # no outlier columns (narrow_from above)
    ids = torch.randint(1, 96, (9,), generator=torch.Generator().manual_seed(5)).tolist()  # 5 prompt, 4 generated
    for name in ("int16", "int8 decodes"):  # the prompt, then one decode a step
        p = plan(ids[:5], [0], [5], [[0]], [0], 0)
        p.prompt_lens = [5]
        run[name].execute(p)
        for t in range(5, 9):
            p = plan([ids[t]], [t], [1], [[0]], [0], 1)
            p.prompt_lens = [5]
            run[name].execute(p)
    p = plan(ids, [0], [9], [[0]], [0], 0)  # a resume: prompt of 5 and the 4 generated tokens, the last sampling
    p.prompt_lens = [5]
    run["int8 resume"].execute(p)
    k0 = {name: r.kv_cache[0, 0].flatten(0, 1)[:9].float() for name, r in run.items()}  # layer 0's keys
    assert [not torch.equal(k0["int16"][t], k0["int8 decodes"][t]) for t in range(9)] == [False] * 5 + [True] * 4
    assert [torch.equal(k0["int8 resume"][t], k0["int8 decodes"][t]) for t in range(9)] == [True] * 9


def test_a_prompts_int8_rows_leave_the_same_kv_however_it_is_chunked():
    """Narrow rows run their matmuls and their attention (tokens in blocks of 24 here: 2 query
    heads a kv head) row by row: a 60-token prompt prefilled whole and in chunks of 25 and 35
    (other blocks, other block edges) leaves bit for bit the same KV and samples the same logits."""
    run = activation_runners(kinds=("int8", "int8 chunked"))
    narrow_from(run)
    ids = torch.randint(1, 96, (60,), generator=torch.Generator().manual_seed(11)).tolist()
    tables = [[0, 1, 2, 3]]

    def step(r, lo, hi, sample):
        p = plan(ids[lo:hi], [lo], [hi - lo], tables, [0] if sample else [], 0)
        p.prompt_lens = [60]
        return r.execute(p)

    whole = step(run["int8"], 0, 60, True).logits
    step(run["int8 chunked"], 0, 25, False)
    chunked = step(run["int8 chunked"], 25, 60, True).logits
    assert torch.equal(whole, chunked)
    kv = {name: r.kv_cache[:, :, :4].flatten(2, 3)[:, :, :60] for name, r in run.items()}  # the prompt's slots
    assert torch.equal(kv["int8"], kv["int8 chunked"])


def test_the_last_layer_goes_on_for_the_logits_rows_alone():
    """Past the last layer's KV store the step computes only the rows whose logits are read
    (`Context.logits_rows`): their logits and every row's KV are bit for bit those of a step
    that computes every row (a Runner keeping hidden states, as training data needs), the
    other rows' hidden states are zeros, and a chunk that samples nothing still stores its
    last layer's KV."""
    cfg = tiny_config(vocab_size=96, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, num_layers=3)
    w = tiny_weights(cfg, seed=6)
    run = {}
    for keep in (False, True):
        run[keep] = Runner(EngineConfig(quantization="int4", num_blocks=12, cpu_threads=2, max_num_seqs=4,
                                        max_num_batched_tokens=64), cfg, w)
        run[keep].allocate_kv(keep_hidden=keep)
        fill_noise(run[keep].kv_cache)
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(1, 96, (40,), generator=g).tolist()
    tables = [[0, 1], [2, 3]]
    steps = [plan(ids[:20] + ids[20:30], [0, 0], [20, 10], tables, [0], 0),  # the second prompt's chunk samples nothing
             plan(ids[30:40] + [7], [10, 20], [10, 1], tables[::-1], [0, 1], 0),
             plan([5, 6], [20, 21], [1, 1], tables, [0, 1], 2)]
    for p in steps:
        out = {keep: r.execute(p) for keep, r in run.items()}
        assert torch.equal(out[False].logits, out[True].logits)
        kv = {keep: r.kv_cache[:, :, :4].flatten(2, 3) for keep, r in run.items()}
        assert torch.equal(kv[False][:, :, :21], kv[True][:, :, :21])
        assert torch.equal(kv[False][:, :, 32:53], kv[True][:, :, 32:53])
    ctx = run[False].prepare(steps[0])[2]
    assert ctx.logits_rows.tolist() == [19]
    hidden = run[False].model(*run[False].prepare(steps[0])[:3], run[False].kv_cache)
    assert hidden[19].abs().sum() > 0 and not hidden[:19].any() and not hidden[20:].any()


def test_calibrated_outlier_columns_take_a_large_channel_out_of_the_int8_blocks():
    """A hidden channel 60x the others (its input norm weight scaled) makes every narrow row's
    int8 block that holds it coarse. Calibration finds that column for the layer's qkv and
    gate/up inputs and computes it in fp32: the narrow rows' layer-0 keys come 5x closer to
    the wide rows' than without."""
    cfg = tiny_config(vocab_size=96, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, num_layers=3)
    w = tiny_weights(cfg, seed=3)
    w["model.layers.0.input_layernorm.weight"][5] *= 60
    run = activation_runners(w, kinds=("int16", "int8", "int8+calibrated"))
    g = torch.Generator().manual_seed(10)
    narrow_from({"int8": run["int8"]})
    narrow_from({"int8+calibrated": run["int8+calibrated"]},
                [torch.randint(1, 96, (n,), generator=g).tolist() for n in (30, 12, 21)])
    p = plan(torch.randint(1, 96, (20,), generator=g).tolist(), [0], [20], [[0, 1]], [0], 0)
    p.prompt_lens = [20]
    keys = {}
    for acts, r in run.items():
        r.execute(p)
        keys[acts] = r.kv_cache[0, 0].flatten(0, 1)[:19].float()  # layer 0's keys of the narrow rows
    err = {acts: (keys[acts] - keys["int16"]).abs().max().item() for acts in ("int8", "int8+calibrated")}
    assert 0 < 5 * err["int8+calibrated"] < err["int8"], err


def test_a_table_past_the_pool_raises_instead_of_ending_the_process():
    fast, _ = runners(False)  # a pool of 12 blocks
    with pytest.raises(RuntimeError, match="block 20 of 12"):
        fast.execute(plan(list(range(1, 21)), [0], [20], [[3, 20]], [0], 0))
    fast.execute(plan(list(range(1, 21)), [0], [20], [[3, 4]], [0], 0))  # the step still runs
