"""The CUDA paths against their eager, synchronous twins on a GPU (`pytest -m gpu`):
every captured decode graph (padding rows included) against the eager forward, and
overlap scheduling against synchronous stepping, in bf16. Collected without a GPU
and without building the C++ CPU extensions; skipped there."""

import random

import pytest
import torch

from wire import protocol as P
from replica.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from replica.model.loader import random_weights
from replica.model.plan import StepPlan
from tests.replica.divergence import check_same_or_near_tie
from tests.replica.tiny import tiny_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# Small, but with real shapes for the kernels: GQA 4:1, head_dim 64, 4 layers.
CFG = tiny_config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8,
                  num_kv_heads=2, max_position_embeddings=2048)


def engine(**kw) -> LLMEngine:
    base = dict(device="cuda", dtype="bfloat16", num_blocks=256, max_num_seqs=16, max_num_batched_tokens=512,
                max_model_len=1024, speculative="off")
    base.update(kw)
    return LLMEngine(EngineConfig(**base), CFG, random_weights(CFG, dtype=torch.bfloat16, seed=0, device="cuda"))


@torch.inference_mode()
def test_every_graph_bucket_replays_the_eager_forward():
    """For each bucket, the smallest batch it serves (every padding row it can have): the
    replayed graph's logits equal the eager forward's over the same rows, within bf16
    rounding (a padded batch may run other GEMM kernels), and the same argmax wherever
    the top two are apart."""
    eng = engine()
    runner, graphs = eng.runner, eng.runner.graphs
    assert graphs is not None and graphs.graphs, "no CUDA graphs captured"
    rng = random.Random(0)
    runner.kv_cache.normal_()  # attention over random keys and values: a wrong block or slot shows
    for prev, b in zip([0] + graphs.buckets, graphs.buckets):
        n = prev + 1  # the smallest batch this bucket serves: the most padding rows
        free = rng.sample(range(1, runner.kv_cache.shape[2]), runner.kv_cache.shape[2] - 1)  # rows share no block
        tables, starts = [], []
        for i in range(n):
            length = rng.randrange(1, 200)
            need = -(-(length + 1) // 16)
            tables.append(free[:need])
            free = free[need:]
            starts.append(length)
        ids = [rng.randrange(CFG.vocab_size) for _ in range(n)]
        plan = StepPlan(input_ids=ids, starts=starts, num_tokens=[1] * n, block_tables=tables,
                        sample_rows=list(range(n)), num_decodes=n)
        input_ids, positions, ctx, rows = runner.prepare(plan)
        eager = runner.model.compute_logits(runner.model(input_ids, positions, ctx, runner.kv_cache)[rows]).float()
        replayed, _ = graphs.run(plan)
        assert graphs.bucket_for(n) == b and b in graphs.graphs
        assert torch.isfinite(replayed).all()
        scale = eager.abs().max().item()
        err = (replayed - eager).abs().max().item()
        assert err <= 2e-2 * scale, f"bucket {b}: max |graph - eager| {err:.4g} against logits of scale {scale:.4g}"
        top2 = eager.topk(2, dim=-1).values
        apart = (top2[:, 0] - top2[:, 1]) > 4e-2 * scale
        assert torch.equal(replayed.argmax(-1)[apart], eager.argmax(-1)[apart]), f"bucket {b}: argmax differs"


def _greedy_run(eng: LLMEngine, prompts: dict[str, list[int]], max_tokens: int, keep_logits: bool):
    sp = P.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for rid, ids in prompts.items():
        assert eng.add(P.Generate(id=rid, prompt_ids=ids, sampling=sp)) is None
    toks: dict[str, list[int]] = {k: [] for k in prompts}
    logits: dict[str, list[torch.Tensor]] = {k: [] for k in prompts}
    while eng.has_work():
        out, lg = eng.step(return_logits=True) if keep_logits else (eng.step(), {})
        for rid, row in lg.items():
            logits[rid].append(row.cpu())
        for m in out:
            toks[m.id].extend(m.ids)
    return toks, logits


def test_overlap_gives_the_tokens_of_synchronous_stepping():
    """Step N+1 launched before step N is read back (placeholders resolved on the device)
    emits what synchronous stepping emits, through graphs and prefill chunks alike."""
    rng = random.Random(1)
    prompts = {f"r{i}": [rng.randrange(1, CFG.vocab_size) for _ in range(n)]
               for i, n in enumerate((3, 17, 64, 200, 31, 9))}
    sync_eng = engine(overlap=False)
    want, logits = _greedy_run(sync_eng, prompts, 48, keep_logits=True)
    del sync_eng
    overlap_eng = engine(overlap=True)
    assert overlap_eng.overlap and overlap_eng.runner.graphs.graphs
    got, _ = _greedy_run(overlap_eng, prompts, 48, keep_logits=False)
    for rid in prompts:
        assert len(got[rid]) == len(want[rid]) == 48
        check_same_or_near_tie(got[rid], want[rid], logits[rid], f"request {rid}")


def test_the_api_process_finds_the_gpus_torch_finds_without_importing_torch():
    from replica.__main__ import cuda_devices

    assert cuda_devices() == torch.cuda.device_count() > 0


@torch.inference_mode()
def test_kv_blocks_move_through_pinned_staging_as_the_cpu_path_lays_them_out():
    """A KV transfer on CUDA (replica.model.kv_staging): the blocks read are the pool's bytes in
    the travel layout, and written into other blocks they read back the same."""
    runner = engine().runner
    runner.kv_cache.normal_()
    ids, others = [7, 1, 30], [40, 41, 90]
    got = bytearray(len(ids) * runner.block_nbytes())
    runner.read_blocks(ids, got)
    want = b"".join(t.select(d, b).cpu().contiguous().view(torch.uint8).numpy().tobytes()
                    for b in ids for t, d in runner.kv_pools())
    assert got == want
    runner.write_blocks(others, got)
    assert torch.equal(runner.kv_cache[:, :, others], runner.kv_cache[:, :, ids])
