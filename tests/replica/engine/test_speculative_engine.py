"""Speculative decoding inside the engine's continuous batching: with speculation
on, output is token for token the output with it off (greedy, and seeded
sampling), through chunked prefill, preemption, abort and stops, at batch 1 and 8
(tiny target, and the default model); rejected drafts' blocks go back; accepted
drafts are reported in usage; sampled drafts are reproducible and batch-independent."""

import random

import pytest

from wire import protocol as P
from replica.engine.block_manager import BlockManager
from replica.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from replica.engine.sequence import Sequence
from replica.engine.speculation import auto_kind
from speculative.tree_spec import TreeSpec
from speculative.head import save_head
from speculative.policy import SpecPolicy
from tests.replica.spec_engines import CFG, DRAFTERS, W, engine
from tests.speculative.util import OracleDrafter, random_head, tiny_target


def greedy(max_tokens=14, **kw):
    return P.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def prompts(lengths, seed=0):
    rng = random.Random(seed)
    out = {}
    for i, n in enumerate(lengths):
        if i % 2:  # a repetitive prompt: n-gram lookup has something to find
            unit = [rng.randrange(1, 97) for _ in range(5)]
            out[f"s{i}"] = (unit * n)[:n]
        else:
            out[f"s{i}"] = [rng.randrange(1, 97) for _ in range(n)]
    return out


def run(eng, reqs: dict, sampling, abort_after: dict | None = None):
    """Add reqs, step until idle; {id: generated ids}, {id: Finished}. abort_after: {id: step}."""
    for k, ids in reqs.items():
        assert eng.add(P.Generate(id=k, prompt_ids=ids, sampling=sampling(k) if callable(sampling) else sampling)) \
            is None
    toks, fins, step = {}, {}, 0
    while eng.has_work():
        for m in eng.step():
            toks.setdefault(m.id, []).extend(m.ids)
            if isinstance(m, P.Finished):
                fins[m.id] = m
        step += 1
        for k, s in (abort_after or {}).items():
            if s == step:
                fins[k] = eng.abort(k)
    eng.blocks.check_invariants()
    assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.seqs
    return toks, fins


BATCH8 = prompts([5, 20, 37, 60, 9, 14, 3, 45])  # 60 and 45 tokens: prefill in chunks


@pytest.fixture(scope="module")
def baseline():
    return run(engine(), BATCH8, greedy())[0]


@pytest.mark.parametrize("spec", list(DRAFTERS))
def test_greedy_identical_at_batch_8_with_chunked_prefill(spec, head_path, baseline):
    eng = engine(spec, head_path)
    toks, fins = run(eng, BATCH8, greedy())
    assert toks == baseline
    assert all(f.usage.completion_tokens == 14 for f in fins.values())
    if spec == "ngram":
        assert sum(f.usage.accepted_draft_tokens for f in fins.values()) > 0


@pytest.mark.parametrize("spec", list(DRAFTERS))
def test_greedy_identical_at_batch_1(spec, head_path, baseline):
    toks, _ = run(engine(spec, head_path), {"s3": BATCH8["s3"]}, greedy())  # 60-token prompt: chunked
    assert toks["s3"] == baseline["s3"]


def test_ngram_accepts_drafts_on_a_repetitive_prompt():
    reqs = {"r": [11, 12, 13, 14, 15, 16] * 6}
    plain = engine()
    base, _ = run(plain, reqs, greedy(40))
    spec = engine("ngram")
    toks, fins = run(spec, reqs, greedy(40))
    assert toks == base
    assert fins["r"].usage.accepted_draft_tokens > 0
    assert spec.stats.steps < plain.stats.steps and spec.stats.tau > 1.0  # several tokens per target forward
    assert plain.stats.tau == 1.0 and spec.stats.accepted == fins["r"].usage.accepted_draft_tokens


@pytest.mark.parametrize("spec", ["ngram", "eagle3-tree"])
def test_preemption_gives_the_same_tokens(spec, head_path):
    reqs = prompts([30, 31, 30, 29], seed=3)
    base, _ = run(engine(), reqs, greedy(18))
    eng = engine(spec, head_path, num_blocks=11)  # cannot hold four 48-token sequences plus lookahead
    toks, _ = run(eng, reqs, greedy(18))
    assert eng.scheduler.num_preemptions > 0
    assert toks == base


@pytest.mark.parametrize("spec", ["ngram", "eagle3-tree"])
def test_abort_mid_speculation_frees_blocks(spec, head_path, baseline):
    toks, fins = run(engine(spec, head_path), BATCH8, greedy(), abort_after={"s1": 6, "s4": 2})
    assert fins["s1"].finish_reason == "abort" and fins["s4"].finish_reason == "abort"
    for k in BATCH8:
        if k in ("s1", "s4"):
            assert toks.get(k, []) == baseline[k][: len(toks.get(k, []))]
        else:
            assert toks[k] == baseline[k]


def test_stops_and_max_tokens_cut_accepted_runs():
    reqs = {"r": [21, 22, 23, 24] * 8, "q": [40, 41, 42] * 9}
    base, _ = run(engine(), reqs, greedy(40))
    stop = base["r"][9]

    def sp(k):
        return greedy(13, stop_token_ids=[stop]) if k == "r" else greedy(13)

    want, want_fins = run(engine(), reqs, sp)
    toks, fins = run(engine("ngram"), reqs, sp)
    assert toks == want
    assert toks["r"] == base["r"][: base["r"].index(stop) + 1] and len(toks["q"]) == 13
    assert {k: f.finish_reason for k, f in fins.items()} == {k: f.finish_reason for k, f in want_fins.items()}
    assert fins["q"].usage.completion_tokens == 13 and fins["q"].usage.accepted_draft_tokens > 0


@pytest.mark.parametrize("spec", ["ngram", "eagle3-tree"])
def test_seeded_sampling_identical_and_batch_independent(spec, head_path):
    def sp(k):
        return P.SamplingParams(max_tokens=16, temperature=0.4, top_p=0.95, seed=int(k[1:]), ignore_eos=True)

    base, _ = run(engine(), BATCH8, sp)
    toks, fins = run(engine(spec, head_path), BATCH8, sp)
    assert toks == base
    assert sum(f.usage.accepted_draft_tokens for f in fins.values()) > 0
    alone, _ = run(engine(spec, head_path), {"s3": BATCH8["s3"]}, sp)  # batch 1: deeper drafts
    assert alone["s3"] == base["s3"]


class _Oracle(OracleDrafter):
    @property
    def k(self) -> int:  # draft tokens per tree, for the scheduler's budget
        return 2 * self.depth


def test_oracle_trees_accept_long_paths_off_the_first_branch(baseline):
    """Accepted nodes sit on second branches: their KV moves down before the next step reads it."""
    eng = engine("ngram")
    eng.speculator._specs = [None] + [_Oracle([p + baseline[k] for k, p in BATCH8.items()], depth=3)] * 16
    toks, fins = run(eng, BATCH8, greedy())
    assert toks == baseline
    assert sum(f.usage.accepted_draft_tokens for f in fins.values()) > 40


def test_depth_tapers_with_batch_and_turns_off():
    eng = engine("ngram", spec_max_batch=8, spec_depth=6, max_num_batched_tokens=64)
    ks = [eng.speculator.spec_for(b).k for b in range(1, 9)]
    assert ks[0] == 6 and ks == sorted(ks, reverse=True) and ks[-1] == 1
    assert eng.speculator.spec_for(9) is None and eng.speculator.spec_for(0) is None
    tight = engine("ngram", spec_depth=6, max_num_batched_tokens=16)  # 8 decodes x (1 + k) must fit 16 tokens
    assert tight.speculator.spec_for(8).k == 1


def test_measured_policy_beside_the_head_decides_per_batch(tmp_path):
    """A policy.json measured on this device type replaces the taper; it is cut to the token budget."""
    folder = save_head(random_head(tiny_target()), tmp_path / "head")
    tree, chain = TreeSpec(depth=3, top_k=2, budget=6), TreeSpec.chain(2)
    SpecPolicy(((1, tree), (3, chain), (5, None)), device="cpu").save(folder)
    eng = engine("eagle3-chain", str(folder), max_num_batched_tokens=40)
    sp = eng.speculator.spec_for
    assert [sp(b) for b in (1, 2, 3, 4, 5, 8)] == [tree, tree, chain, chain, None, None]
    small = engine("eagle3-chain", str(folder), max_num_batched_tokens=12).speculator.spec_for
    assert small(2) == TreeSpec(depth=2, top_k=2, budget=5) and small(3) == TreeSpec.chain(2)
    assert engine("eagle3-chain", str(folder), spec_policy="taper").speculator.spec_for(5) == TreeSpec.chain(3)
    SpecPolicy(((1, None),), device="cuda").save(folder)  # measured elsewhere: the taper
    assert engine("eagle3-chain", str(folder)).speculator.spec_for(1) == TreeSpec.chain(3)
    with pytest.raises(ValueError, match="measured on cuda"):
        engine("eagle3-chain", str(folder), spec_policy=str(folder))


def test_policy_engine_output_is_the_plain_output(tmp_path, baseline):
    folder = save_head(random_head(tiny_target()), tmp_path / "head")
    SpecPolicy(((1, TreeSpec(depth=3, top_k=2, budget=5)), (4, TreeSpec.chain(1)), (6, None)), "cpu").save(folder)
    toks, _ = run(engine("eagle3-chain", str(folder)), BATCH8, greedy())
    assert toks == baseline


def test_truncate_releases_draft_blocks_and_keeps_hashes_verified():
    bm = BlockManager(8, 4)
    seq = Sequence("x", list(range(1, 10)), greedy(), seed=0, eos_ids=frozenset())
    assert bm.allocate(seq, 9 + 6)  # prompt + 6 slots of drafts: 4 blocks
    seq.num_computed = 9
    bm.commit(seq)
    assert len(bm.stored) == 2  # only blocks full of computed tokens are registered
    bm.truncate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free == 5
    bm.free(seq)
    bm.check_invariants()
    assert bm.num_free == 8


def test_missing_head_is_named():
    with pytest.raises(FileNotFoundError, match="speculative.train"):
        engine("eagle3-chain", "/nonexistent/head")


@pytest.fixture(scope="module")
def default_model():
    """The default model, built once, and eight chat prompts."""
    import kernels
    from replica.model.loader import load_checkpoint
    from replica.model.runner import build_model

    ckpt = load_checkpoint("default")
    model = build_model(ckpt.config, EngineConfig(), ckpt.weights, kernels.ops("cpu"), 1024)
    prompts = {f"p{i}": ckpt.tokenizer.encode_chat([{"role": "user", "content": q}]) for i, q in enumerate((
        "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
        "Explain recursion in one sentence.", "Say hello in Spanish.", "What is 2 + 2?",
        "Name a famous painter.", "Write a Python function that adds two numbers."))}
    return ckpt, model, prompts


def default_engine(ckpt, model, **kw):
    cfg = dict(num_blocks=96, max_num_batched_tokens=128, max_num_seqs=8, spec_max_batch=8)
    return LLMEngine(EngineConfig(**(cfg | kw)), ckpt.config, model=model, ops=model.ops)


def test_default_model_ngram_same_greedy_text(default_model):
    ckpt, model, _ = default_model
    ids = ckpt.tokenizer.encode_chat([{"role": "user", "content": "Repeat after me: one two three, one two three."}])
    out = {}
    for spec in ("off", "ngram"):
        toks, fins = run(default_engine(ckpt, model, speculative=spec), {"g": ids},
                         P.SamplingParams(max_tokens=16, temperature=0.0))
        out[spec] = (ckpt.tokenizer.decode(toks["g"]), fins["g"].usage.accepted_draft_tokens)
    assert out["ngram"][0] == out["off"][0] == "One two three, one two three."
    assert out["off"][1] == 0 and out["ngram"][1] > 0  # the answer quotes the prompt: lookup drafts it


def test_default_model_greedy_identical_at_batch_1_and_8(default_model, tmp_path):
    """EAGLE-2 trees from an untrained head, and oracle trees whose accepted paths leave
    the first branch, on the real model: the verify forward and KV moves keep every token."""
    ckpt, model, prompts = default_model
    sp = P.SamplingParams(max_tokens=12, temperature=0.0)
    base, _ = run(default_engine(ckpt, model), prompts, sp)
    head = str(save_head(random_head(model, draft_vocab=2048), tmp_path / "head"))
    oracle = _Oracle([p + base[k] for k, p in prompts.items()], depth=4, vocab=model.cfg.vocab_size)
    tree = default_engine(ckpt, model, speculative="eagle3", spec_head=head, spec_depth=3, spec_top_k=2,
                          spec_budget=6)
    assert run(tree, prompts, sp)[0] == base  # batch 8
    assert run(default_engine(ckpt, model, speculative="eagle3", spec_head=head, spec_depth=3), {"p7": prompts["p7"]},
               sp)[0]["p7"] == base["p7"]  # batch 1, a chain
    for batch in (prompts, {"p7": prompts["p7"]}):
        eng = default_engine(ckpt, model, speculative="ngram")
        eng.speculator._specs = [None] + [oracle] * 8
        toks, fins = run(eng, batch, sp)
        assert toks == {k: base[k] for k in batch}
        assert eng.stats.accepted > 0 and eng.stats.accepted == sum(f.usage.accepted_draft_tokens
                                                                    for f in fins.values())


def test_decodes_near_the_context_end_fall_back_to_plain():
    """A lookahead past max_model_len would draft positions the replica cannot hold."""
    reqs = {"r": [31, 32, 33] * 10, "q": [5, 6, 7, 8] * 5}
    base, want = run(engine(max_model_len=40), reqs, greedy(30))
    toks, fins = run(engine("ngram", max_model_len=40), reqs, greedy(30))
    assert toks == base and len(toks["r"]) == 10
    assert fins["r"].finish_reason == want["r"].finish_reason == "length"


def test_auto_speculates_only_where_a_policy_measured_on_this_device_type_pays(tmp_path, monkeypatch):
    """`--speculative auto`: no head, a head without a policy, a policy measured on another
    device type or one that never speculates: plain decoding; a policy measured here that
    speculates somewhere: EAGLE-3. The operator's explicit taper still speculates."""
    monkeypatch.setenv("EDGECHAT_EAGLE3_DIR", str(tmp_path))
    auto = dict(speculative="auto", num_blocks=64, max_num_seqs=8, max_num_batched_tokens=40)
    assert LLMEngine(EngineConfig(**auto), CFG, W).speculator is None  # no head: off
    folder = save_head(random_head(tiny_target()), tmp_path / CFG.name)
    assert LLMEngine(EngineConfig(**auto), CFG, W).speculator is None  # a head, never measured: off
    eng = LLMEngine(EngineConfig(**auto, spec_policy="taper"), CFG, W)  # asked for: the taper
    assert eng.speculator is not None and eng.cfg.speculative == "eagle3"
    SpecPolicy(((1, TreeSpec.chain(2)), (4, None)), device="cuda").save(folder)  # measured elsewhere: off
    assert LLMEngine(EngineConfig(**auto), CFG, W).speculator is None
    SpecPolicy(((1, None),), device="cpu").save(folder)  # measured here: plain decoding always wins
    assert LLMEngine(EngineConfig(**auto), CFG, W).speculator is None
    SpecPolicy(((1, TreeSpec.chain(2)), (4, None)), device="cpu").save(folder)  # measured here, pays at 1-3
    eng = LLMEngine(EngineConfig(**auto), CFG, W)
    assert eng.speculator is not None and eng.speculator.kind == "eagle3" and eng.cfg.speculative == "eagle3"
    assert eng.speculator.spec_for(1) == TreeSpec.chain(2) and eng.speculator.spec_for(4) is None


def test_a_head_with_a_cpu_policy_on_a_cuda_config_serves_plain_decoding(tmp_path):
    """The H200 case: a head and the policy measured on CPU beside it, an engine on cuda:N."""
    folder = save_head(random_head(tiny_target()), tmp_path / "head")
    SpecPolicy(((1, TreeSpec.chain(3)), (8, None)), device="cpu", measured_on="AMD EPYC").save(folder)
    for device in ("cuda", "cuda:1"):
        cfg = EngineConfig(device=device, speculative="auto", spec_head=str(folder))
        assert auto_kind(cfg, CFG) == "off"
    assert auto_kind(EngineConfig(device="cpu", speculative="auto", spec_head=str(folder)), CFG) == "eagle3"


def test_plain_decodes_of_a_speculating_engine_run_through_the_decode_graphs(head_path, baseline, monkeypatch):
    """Above spec_max_batch the steps are plain decodes: they replay the graphs (padded
    buffers, eagerly on CPU), which also hand the head its features; output unchanged."""
    from replica.model.graphs import DecodeGraphs

    calls = []
    graph_run = DecodeGraphs.run

    def spy(self, plan, prev_tokens=None):
        out = graph_run(self, plan, prev_tokens)
        calls.append(len(plan.starts))
        assert isinstance(out, tuple) and out[1].shape == (len(plan.starts), 3 * CFG.hidden_size)
        return out

    monkeypatch.setattr(DecodeGraphs, "run", spy)
    eng = engine("eagle3-chain", head_path, graph_mode="buffers", spec_max_batch=2)
    assert eng.runner.graphs.aux_layers == eng.speculator.aux_layers
    toks, _ = run(eng, BATCH8, greedy())
    assert toks == baseline and calls and max(calls) > 2


def test_sampled_drafts_are_reproducible_and_batch_independent(head_path, baseline):
    """spec_sample: chains drawn from the head's q, verified by rejection sampling. Greedy
    rows keep the plain tokens; sampled rows depend on (seed, position) only."""
    def sp(k):
        return P.SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=int(k[1:]), ignore_eos=True)

    def sampled_engine():
        return engine("eagle3-chain", head_path, spec_sample=True)

    a, fins = run(sampled_engine(), BATCH8, sp)
    assert run(sampled_engine(), BATCH8, sp)[0] == a and all(len(t) == 16 for t in a.values())
    assert sum(f.usage.accepted_draft_tokens for f in fins.values()) > 0
    alone, _ = run(sampled_engine(), {"s3": BATCH8["s3"], "s6": BATCH8["s6"]}, sp)
    assert alone == {k: a[k] for k in ("s3", "s6")}
    assert run(sampled_engine(), BATCH8, greedy())[0] == baseline
    with pytest.raises(ValueError, match="spec_sample"):
        engine("ngram", spec_sample=True)


@pytest.mark.parametrize("spec", ["ngram", "eagle3-chain"])
@pytest.mark.parametrize("graph_mode", ["off", "buffers"])
def test_overlap_with_speculation_gives_the_same_tokens(spec, graph_mode, head_path, baseline):
    """Plain steps overlap (placeholders resolved on the device); a step that drafts first
    drains the pipeline. spec_max_batch 3 with 8 requests: both kinds of step, and switches."""
    eng = engine(spec, head_path, overlap=True, graph_mode=graph_mode, spec_max_batch=3)
    assert eng.overlap and eng.speculator is not None
    toks, fins = run(eng, BATCH8, greedy())
    assert toks == baseline and all(f.usage.completion_tokens == 14 for f in fins.values())
    seeded = run(engine(spec, head_path, overlap=True, spec_max_batch=3), BATCH8,
                 lambda k: P.SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True))[0]
    plain = run(engine(), BATCH8,
                lambda k: P.SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True))[0]
    assert seeded == plain
