"""EAGLE-3 through the decode graphs.

CPU: graph_mode="buffers" runs the graphs' padded-buffer path eagerly, writing the
same static outputs a replay writes. A speculating engine feeds its head the aux
features of every plain step and keeps them until its next draft, so features
handed out as views of a graph's static output would be overwritten by the next
replay: drafts would then differ, and with them the accepted draft tokens, while
the emitted tokens (verified) stay the same. Hence the invariant checked: the
same drafts, accepted counts and tokens as the engine without graphs.

GPU (`-m gpu`): greedy EAGLE-3 under CUDA graphs in bf16, with overlap, emits the
plain decoder's tokens (same graphs), with a random head (nothing accepted) and with
a head trained there (drafts accepted: KV moves, several tokens a step). bf16
rounding may break a near-tie the other way between the two paths' batch shapes, so
at the first differing token the plain decoder's logits of both tokens must lie within
tests/replica/divergence.BF16_TIE of the row's scale (its top two are then a near-tie).
Collected without a GPU and without building a C++ extension; skipped there.
"""

import random

import pytest
import torch

import kernels
from wire import protocol as P
from replica.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from replica.model.loader import random_weights
from replica.model.runner import build_model
from speculative.head import Eagle3Head, HeadConfig, aux_layers_for, save_head
from speculative.train import draft_vocab, init_head, self_distill, train
from tests.replica.divergence import check_same_or_near_tie
from tests.replica.tiny import tiny_config, tiny_weights

CFG = tiny_config(num_layers=4)  # four layers: the head's three feature layers are distinct


def quiet_layers(w: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """w with its layers' outputs scaled by `scale`: the target's next token then depends
    mostly on the current one, which a head learns in seconds (a random head accepts
    nothing, and equal accepted counts of 0 would prove nothing)."""
    return {k: v * scale if k.endswith(("o_proj.weight", "down_proj.weight")) else v for k, v in w.items()}


def trained_head(model, path) -> str:
    """An EAGLE-3 head trained briefly (speculative.train) on the target's own greedy
    answers to 24 random prompts, saved at `path`."""
    cfg, V = model.cfg, model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, V, (int(n),), generator=g).tolist() for n in torch.randint(4, 30, (24,), generator=g)]
    convs = self_distill(model, prompts, aux_layers_for(cfg.num_layers), max_tokens=40, temperature=0.0, seed=0,
                         batch_size=8)
    data = {k: [c[k] for c in convs] for k in ("ids", "n_prompt", "aux", "hidden", "top1")}
    head = init_head(HeadConfig.for_target(cfg, V), model, draft_vocab(data, V, V))
    train(head, model, data, None, epochs=20, ttt_steps=4, lr=3e-3, batch_tokens=512, progress=False)
    return str(save_head(head, path))


W = quiet_layers(tiny_weights(CFG), 0.1)


@pytest.fixture(scope="module")
def head_path(tmp_path_factory):
    model = build_model(CFG, EngineConfig(graph_mode="off"), W, kernels.ops("cpu"), 512)
    return trained_head(model, tmp_path_factory.mktemp("eagle3") / "tiny")


def run_recording(eng: LLMEngine, reqs: dict[str, tuple[list[int], int]]) -> dict:
    """Step until idle: tokens and accepted drafts (usage) per request, the engine's
    drafted / accepted counters, every speculating step's trees (request, tokens,
    parents per row) and how many steps replayed the decode graphs."""
    drafts, replays, verifies, rounds = [], [], [], []
    draft = eng.speculator.draft

    def recorded_draft(batch):
        trees = draft(batch)
        host = trees if isinstance(trees, list) else trees.trees()  # the head's are on the device
        drafts.append([(s.id, t.tokens, t.parents) for s, t in zip(batch.seqs, host)])
        return trees

    eng.speculator.draft = recorded_draft
    if eng.runner.graphs is not None:
        graph_run = eng.runner.graphs.run

        def counted_run(plan, prev_tokens=None):
            replays.append(len(plan.starts))
            return graph_run(plan, prev_tokens)

        eng.runner.graphs.run = counted_run
    if eng.runner.verify_graphs is not None:
        verify_run = eng.runner.verify_graphs.run

        def counted_verify(plan, drafts):
            verifies.append((len(plan.starts), drafts.nodes))
            return verify_run(plan, drafts)

        eng.runner.verify_graphs.run = counted_verify
    if eng.speculator.drafter.graphs is not None:
        levels_run = eng.speculator.drafter.graphs.run

        def counted_levels(drafter, spec, inputs):
            rounds.append((inputs[0].shape[0], spec))
            return levels_run(drafter, spec, inputs)

        eng.speculator.drafter.graphs.run = counted_levels
    for k, (ids, n) in reqs.items():
        sp = P.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        assert eng.add(P.Generate(id=k, prompt_ids=ids, sampling=sp)) is None
    toks, accepted = {}, {}
    while eng.has_work():
        for m in eng.step():
            toks.setdefault(m.id, []).extend(m.ids)
            if isinstance(m, P.Finished):
                accepted[m.id] = m.usage.accepted_draft_tokens
    assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.seqs
    return dict(tokens=toks, accepted=accepted, counters=(eng.stats.drafted, eng.stats.accepted), drafts=drafts,
                replays=len(replays), verifies=verifies, rounds=rounds)


def cpu_engine(head: str, graph_mode: str, overlap: bool, **kw) -> LLMEngine:
    # Trees of 10 drafts at batch 1, tapering to plain decoding above 2 sequences: with six
    # requests of staggered lengths, runs of plain (graph) steps come before the drafting steps.
    cfg = dict(num_blocks=96, block_size=16, max_num_seqs=8, max_num_batched_tokens=64,
               speculative="eagle3", spec_head=head, spec_depth=4, spec_top_k=3, spec_budget=10,
               spec_max_batch=2, spec_policy="taper", graph_mode=graph_mode, overlap=overlap)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), CFG, W)


@pytest.mark.parametrize("overlap", [False, True])
def test_eagle3_through_graph_buffers_drafts_and_accepts_as_without_graphs(head_path, overlap):
    rng = random.Random(5)
    reqs = {f"r{i}": ([rng.randrange(1, 97) for _ in range(n)], m)
            for i, (n, m) in enumerate([(7, 40), (30, 12), (12, 20), (45, 16), (3, 36), (20, 9)])}
    ref = run_recording(cpu_engine(head_path, "off", overlap), reqs)
    got = run_recording(cpu_engine(head_path, "buffers", overlap), reqs)
    assert ref["replays"] == 0 and got["replays"] >= 10, "the plain steps replay through the graph buffers"
    assert ref["counters"][1] >= 10, "some drafts are accepted: equal counts mean something"
    assert got["tokens"] == ref["tokens"]  # verified: the same whatever the head saw
    assert got["accepted"] == ref["accepted"] and got["counters"] == ref["counters"]  # the head saw the same features
    assert got["drafts"] == ref["drafts"]  # and drafted the same trees, step by step


SHAPES = {"chain": dict(spec_depth=4, spec_top_k=1, spec_budget=0), "tree": dict(spec_depth=4, spec_top_k=3, spec_budget=10)}


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_verify_through_graph_buffers_drafts_and_accepts_as_eager(head_path, shape, rows, overlap):
    """`rows` requests decoding together: after their prefill every step is a pure verify of
    device trees (replica.model.spec_graphs) until the first finishes, padded to its bucket
    (3 -> 4, 5 -> 8), its tokens per row the taper's shape at that batch size (a chain of 4 at
    1 row, 3 at 3, 1 at 5)."""
    rng = random.Random(rows)
    reqs = {f"r{i}": ([rng.randrange(1, 97) for _ in range(5 + i)], 14) for i in range(rows)}
    kw = dict(SHAPES[shape], spec_max_batch=5)
    ref = run_recording(cpu_engine(head_path, "off", overlap, **kw), reqs)
    eng = cpu_engine(head_path, "buffers", overlap, **kw)
    got = run_recording(eng, reqs)
    assert not ref["verifies"] and got["verifies"], "the verify steps ran through the verify buffers"
    assert not ref["rounds"] and len(got["rounds"]) == len(got["drafts"]), "every draft loop ran through its buffers"
    assert any(k[0] == "commit" for k in eng.speculator.drafter.graphs.outputs), "commits through their buffers"
    assert got["verifies"][0][0] == rows, got["verifies"]  # the first drafting step: all rows at once
    assert ref["counters"][1] >= 2, f"some drafts are accepted: {ref['counters']}"
    assert got["tokens"] == ref["tokens"]
    assert got["accepted"] == ref["accepted"] and got["counters"] == ref["counters"]
    assert got["drafts"] == ref["drafts"]


def test_draft_graph_padding_rows_write_no_head_kv(head_path):
    """Three rows drafting through the draft graphs' buffers (bucket 4: one padding row): a
    round changes the head's KV only at the real rows' scratch slots (positions len ..
    len + lookahead - 1). A padding row's slots are -1; computed from its zero block table
    they would be block 0's, which the first sequence owns."""
    eng = cpu_engine(head_path, "buffers", False, spec_max_batch=5, spec_top_k=1, spec_budget=0)
    kv, graphs, rounds = eng.runner.draft_kv, eng.speculator.drafter.graphs, []
    run, bs = graphs.run, eng.cfg.block_size
    bits = {4: torch.int32, 2: torch.int16}[kv.element_size()]  # bitwise: the pool holds stale NaNs too

    def checked_run(drafter, spec, inputs):
        before = kv.clone()
        out = run(drafter, spec, inputs)
        changed = (kv.view(bits) != before.view(bits)).flatten(1, 2).flatten(2).any(-1).any(0)  # (slots,)
        tables, lens = inputs[4].tolist(), inputs[3].tolist()
        scratch = {t[p // bs] * bs + p % bs for t, n in zip(tables, lens) for p in range(n, n + spec.lookahead)}
        rows = inputs[0].shape[0]
        rounds.append((rows, graphs.bucket_for(rows), set(changed.nonzero().flatten().tolist()) - scratch))
        return out

    graphs.run = checked_run
    rng = random.Random(3)
    run_recording(eng, {f"r{i}": ([rng.randrange(1, 97) for _ in range(5 + i)], 10) for i in range(3)})
    assert any(b > n for n, b, _ in rounds), "some rounds had padding rows"
    assert all(not stray for _, _, stray in rounds), rounds


# -- on a GPU: bf16 under CUDA graphs --------------------------------------------------------

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Small, with real shapes for the kernels: GQA 4:1, head_dim 64; six layers (the head reads 0, 3 and 5).
# A small vocabulary: the trained head sees most of its transitions in a few hundred answers.
GPU_CFG = tiny_config(vocab_size=128, hidden_size=512, intermediate_size=1024, num_layers=6, num_heads=8,
                      num_kv_heads=2, max_position_embeddings=2048)
# (prompt tokens, max tokens): four, then three decode plainly (graph replays, features for the
# head) until two remain, which speculate for their last 24 or more tokens
GPU_REQUESTS = ((3, 48), (17, 40), (64, 16), (200, 12))


def gpu_requests() -> dict[str, tuple[list[int], int]]:
    rng = random.Random(1)
    return {f"g{i}": ([rng.randrange(1, GPU_CFG.vocab_size) for _ in range(n)], m)
            for i, (n, m) in enumerate(GPU_REQUESTS)}


def gpu_engine(weights: dict, **kw) -> LLMEngine:
    cfg = dict(device="cuda", dtype="bfloat16", num_blocks=128, max_num_seqs=4, max_num_batched_tokens=512,
               max_model_len=1024, graph_mode="auto")
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg), GPU_CFG, weights)


def plain_with_logits(eng: LLMEngine, reqs: dict) -> tuple[dict, dict]:
    """Greedy tokens per request and, per token, the fp32 logits it was chosen from."""
    for k, (ids, n) in reqs.items():
        sp = P.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        assert eng.add(P.Generate(id=k, prompt_ids=ids, sampling=sp)) is None
    toks = {k: [] for k in reqs}
    logits = {k: [] for k in reqs}
    while eng.has_work():
        out, rows = eng.step(return_logits=True)
        for k, row in rows.items():
            logits[k].append(row.float().cpu())
        for m in out:
            toks[m.id].extend(m.ids)
    assert all(len(logits[k]) == len(toks[k]) for k in reqs), "one logits row per token: synchronous steps"
    return toks, logits


def eagle3_against_plain(weights: dict, head: str) -> dict:
    """Greedy EAGLE-3 (trees, overlap and graphs as served on CUDA) against plain decoding under
    the same graphs (synchronous, for the logits); returns the speculating run's record."""
    reqs = gpu_requests()
    plain = gpu_engine(weights, speculative="off", overlap=False)
    assert plain.runner.graphs is not None and plain.runner.graphs.graphs, "no CUDA graphs captured"
    want, logits = plain_with_logits(plain, reqs)
    del plain
    eng = gpu_engine(weights, speculative="eagle3", spec_head=head, spec_policy="taper", spec_max_batch=2,
                     spec_depth=4, spec_top_k=3, spec_budget=10)
    assert eng.speculator.head.fc.weight.is_cuda, "the head must be on the target's device (speculative.loading.load_head)"
    assert eng.overlap and eng.runner.graphs.graphs
    got = run_recording(eng, reqs)
    assert got["replays"] > 0 and got["counters"][0] > 0, "both plain (graph) and speculating steps ran"
    for k in reqs:  # the same tokens, or a first difference at a near-tie of the plain decoder's logits
        assert len(got["tokens"][k]) == len(want[k]) == reqs[k][1]
        check_same_or_near_tie(got["tokens"][k], want[k], logits[k], f"request {k}")
    return got


@pytest.mark.gpu
@needs_gpu
def test_eagle3_random_head_under_cuda_graphs_emits_the_plain_tokens(tmp_path):
    """A random head (nothing accepted): every emitted token is a verify step's bonus token."""
    weights = random_weights(GPU_CFG, dtype=torch.bfloat16, seed=0, device="cuda")
    torch.manual_seed(0)
    head = Eagle3Head(HeadConfig.for_target(GPU_CFG, GPU_CFG.vocab_size), weights["model.embed_tokens.weight"])
    eagle3_against_plain(weights, str(save_head(head, tmp_path / "head")))


@pytest.mark.gpu
@needs_gpu
def test_eagle3_trained_head_under_cuda_graphs_emits_the_plain_tokens(tmp_path):
    """A head trained on the GPU (speculative.train) for a target whose next token depends
    mostly on the current one: drafts are accepted, so accepted paths' KV moves and
    several tokens a step run on the device too."""
    weights = quiet_layers(random_weights(GPU_CFG, dtype=torch.bfloat16, seed=0, device="cuda"), 0.01)
    weights["lm_head.weight"] *= 10  # peaked next-token distributions: few near-ties
    model = build_model(GPU_CFG, EngineConfig(device="cuda", dtype="bfloat16", graph_mode="off"), weights,
                        kernels.ops("cuda"), 1024)
    head = trained_head(model, tmp_path / "head")
    del model
    got = eagle3_against_plain(weights, head)
    assert got["counters"][1] >= 10, f"the trained head's drafts are accepted: (drafted, accepted) {got['counters']}"


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape", list(SHAPES))
def test_speculative_step_replays_equal_eager_under_cuda_graphs(tmp_path, shape):
    """bf16 on CUDA, overlap on: the verify replayed from its graphs (captured at start for
    every bucket) and the draft loop from its (captured at first use) give the tokens, drafts
    and accepted counts of the same padded-buffer path run eagerly (graph_mode="buffers"), at 1
    row and at 3 (bucket 4: a padding row)."""
    weights = quiet_layers(random_weights(GPU_CFG, dtype=torch.bfloat16, seed=0, device="cuda"), 0.01)
    weights["lm_head.weight"] *= 10  # peaked next-token distributions: drafts accepted
    model = build_model(GPU_CFG, EngineConfig(device="cuda", dtype="bfloat16", graph_mode="off"), weights,
                        kernels.ops("cuda"), 1024)
    head = trained_head(model, tmp_path / "head")
    del model
    kw = dict(SHAPES[shape], speculative="eagle3", spec_head=head, spec_policy="taper", spec_max_batch=4)
    rng = random.Random(2)
    for rows in (1, 3):
        reqs = {f"g{i}": ([rng.randrange(1, GPU_CFG.vocab_size) for _ in range(9 + 5 * i)], 24) for i in range(rows)}
        eng = gpu_engine(weights, graph_mode="auto", **kw)
        assert eng.overlap and eng.runner.verify_graphs.graphs, "verify graphs captured at start"
        got = run_recording(eng, reqs)
        assert eng.speculator.drafter.graphs.graphs, "draft graphs captured"
        assert got["verifies"] and got["rounds"], "both ran"
        del eng
        ref = run_recording(gpu_engine(weights, graph_mode="buffers", **kw), reqs)
        assert got["counters"][1] > 0, f"drafts accepted at {rows} rows: {got['counters']}"
        assert got["tokens"] == ref["tokens"] and got["drafts"] == ref["drafts"], f"{rows} rows"
        assert got["accepted"] == ref["accepted"] and got["counters"] == ref["counters"], f"{rows} rows"
