"""The engine end to end on a tiny random Llama: logits against the plain
reference forward, prefix reuse, preemption, abort, seeded sampling."""

import time

import pytest
import torch

from wire import protocol as P
from replica.config import EngineConfig, RopeScaling
from replica.engine.llm_engine import LLMEngine
from tests.replica.engines import make_engine, prompts, run
from tests.replica.reference import reference_logits
from tests.replica.tiny import tiny_config


def greedy(max_tokens=8, **kw):
    return P.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("model_kw", [
    {},
    {"attention_bias": True, "tie_word_embeddings": True},  # Qwen2-style
    {"rope_scaling": RopeScaling(factor=8.0, original_max_position_embeddings=32)},  # Llama-3 scaling
    {"num_kv_heads": 6},  # MHA
    {"graph_mode": "buffers"},  # decode through the padded CUDA-graph buffers (run eagerly on CPU)
])
def test_logits_match_reference_through_chunked_prefill_and_decode(model_kw):
    graph_mode = model_kw.pop("graph_mode", "auto")
    engine, cfg, w = make_engine(tiny_config(**model_kw), graph_mode=graph_mode)
    assert (engine.runner.graphs is not None) == (graph_mode == "buffers")
    ps = prompts([5, 40, 17, 33, 16])
    for k, ids in ps.items():
        assert engine.add(P.Generate(id=k, prompt_ids=ids, sampling=greedy())) is None
    worst = [0.0]

    def check(logits, toks):
        for k, lg in logits.items():
            ref = reference_logits(cfg, w, ps[k] + toks.get(k, []))[-1]
            worst[0] = max(worst[0], (ref - lg).abs().max().item())
            assert torch.equal(lg.argmax(), ref.argmax()) or (ref - lg).abs().max() < 1e-4

    toks, fins = run(engine, check)
    assert worst[0] < 1e-4
    assert all(len(t) == 8 for t in toks.values()) and all(f.finish_reason == "length" for f in fins.values())
    assert engine.blocks.num_free == engine.blocks.num_blocks


def test_prefix_cache_reuses_blocks_and_keeps_logits():
    engine, cfg, w = make_engine()
    system = prompts([48], seed=1)["s0"]
    engine.add(P.Generate(id="a", prompt_ids=system + [5, 6, 7], sampling=greedy(4)))
    _, fins = run(engine)
    assert fins["a"].usage.cached_tokens == 0
    stored, _ = engine.blocks.drain_events()
    assert len(stored) >= 3  # three full prompt blocks published
    b_ids = system + [9, 10]
    engine.add(P.Generate(id="b", prompt_ids=b_ids, sampling=greedy(4)))

    def check(logits, toks):
        for k, lg in logits.items():
            assert (reference_logits(cfg, w, b_ids + toks.get(k, []))[-1] - lg).abs().max() < 1e-4

    _, fins = run(engine, check)
    assert fins["b"].usage.cached_tokens == 48
    # Another tenant's salt never hits those blocks.
    engine.add(P.Generate(id="c", prompt_ids=b_ids, sampling=greedy(2), cache_salt="tenant-2"))
    _, fins = run(engine)
    assert fins["c"].usage.cached_tokens == 0


def test_fully_cached_prompt_still_computes_its_last_token():
    engine, cfg, w = make_engine()
    ids = prompts([32], seed=2)["s0"]  # exactly two blocks
    for rid in ("a", "b"):
        engine.add(P.Generate(id=rid, prompt_ids=ids, sampling=greedy(3)))
        toks, fins = run(engine)
    assert fins["b"].usage.cached_tokens == 16  # the last block is recomputed for its logits
    assert toks["b"] == [int(reference_logits(cfg, w, ids)[-1].argmax())] + toks["b"][1:]


def test_preemption_by_recompute_gives_the_same_tokens():
    ps = prompts([30, 30, 30, 30], seed=3)
    alone = {}
    for k, ids in ps.items():
        engine, _, _ = make_engine()
        engine.add(P.Generate(id=k, prompt_ids=ids, sampling=greedy(20)))
        alone.update(run(engine)[0])
    # 12 blocks cannot hold four 50-token sequences: the scheduler must preempt.
    engine, _, _ = make_engine(num_blocks=12)
    for k, ids in ps.items():
        engine.add(P.Generate(id=k, prompt_ids=ids, sampling=greedy(20)))
    toks, _ = run(engine)
    assert engine.scheduler.num_preemptions > 0
    assert toks == alone
    assert engine.blocks.num_free == 12


def test_interactive_requests_run_before_batch_ones():
    engine, _, _ = make_engine(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        engine.add(P.Generate(id=f"batch{i}", prompt_ids=[1, 2, 3], sampling=greedy(4), priority=P.BATCH))
    engine.add(P.Generate(id="inter", prompt_ids=[4, 5, 6], sampling=greedy(4), priority=P.INTERACTIVE))
    first = {m.id for m in engine.step()}
    assert "inter" in first and len(first) == 2


def test_abort_frees_blocks_at_any_step():
    engine, _, _ = make_engine()
    engine.add(P.Generate(id="long", prompt_ids=prompts([60])["s0"], sampling=greedy(50)))
    engine.add(P.Generate(id="other", prompt_ids=[1, 2, 3], sampling=greedy(3)))
    engine.step()  # mid-prefill (chunk of 24)
    fin = engine.abort("long")
    assert fin.finish_reason == "abort"
    assert engine.abort("long") is None
    run(engine)
    assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.seqs


def test_seeded_sampling_is_independent_of_batch_composition():
    sp = dict(max_tokens=12, temperature=0.9, top_k=40, top_p=0.95, ignore_eos=True)
    engine, _, _ = make_engine()
    engine.add(P.Generate(id="x", prompt_ids=[3, 1, 4, 1, 5], sampling=P.SamplingParams(seed=7, **sp)))
    alone = run(engine)[0]["x"]
    engine, _, _ = make_engine()
    for i in range(6):
        engine.add(P.Generate(id=f"n{i}", prompt_ids=[9, i + 1, 2], sampling=P.SamplingParams(seed=i, **sp)))
    engine.add(P.Generate(id="x", prompt_ids=[3, 1, 4, 1, 5], sampling=P.SamplingParams(seed=7, **sp)))
    assert run(engine)[0]["x"] == alone
    # Resume from the middle continues exactly.
    engine, _, _ = make_engine()
    engine.add(P.Generate(id="x", prompt_ids=[3, 1, 4, 1, 5], resume_ids=alone[:5],
                          sampling=P.SamplingParams(seed=7, **sp)))
    toks, fins = run(engine)
    assert alone[:5] + toks["x"] == alone
    assert fins["x"].usage.completion_tokens == 12


def test_stop_token_ids_and_eos():
    engine, cfg, w = make_engine()
    ids = [5, 6, 7]
    first = int(reference_logits(cfg, w, ids)[-1].argmax())
    engine.add(P.Generate(id="a", prompt_ids=ids, sampling=greedy(10, stop_token_ids=[first])))
    toks, fins = run(engine)
    assert toks["a"] == [first] and fins["a"].finish_reason == "stop"
    engine, _, _ = make_engine(tiny_config(eos_token_ids=(first,)))
    engine.add(P.Generate(id="b", prompt_ids=ids, sampling=P.SamplingParams(max_tokens=10, temperature=0)))
    assert run(engine)[1]["b"].finish_reason == "stop"


@pytest.mark.parametrize("req, problem", [
    (P.Generate(id="a", prompt_ids=[]), "empty"),
    (P.Generate(id="a", prompt_ids=[1] * 600), "context"),
    (P.Generate(id="a", prompt_ids=[1000]), "token ids"),
    (P.Generate(id="a", prompt_ids=[1], sampling=P.SamplingParams(max_tokens=-1)), "max_tokens"),
    (P.Generate(id="a", prompt_ids=[1], sampling=P.SamplingParams(max_tokens=10**9)), "max_tokens"),
    (P.Generate(id="a", prompt_ids=[1], sampling=P.SamplingParams(top_p=0)), "top_p"),
    (P.Generate(id="a", prompt_ids=[1], sampling=P.SamplingParams(temperature=-1)), "temperature"),
    (P.Generate(id="a", prompt_ids=[1], priority=7), "priority"),
])
def test_bad_requests_are_rejected_with_the_problem_named(req, problem):
    engine, _, _ = make_engine()
    err = engine.add(req)
    assert isinstance(err, P.Error) and problem in err.message and err.id == "a"
    assert not engine.has_work()


def test_default_model_logits_match_reference_and_golden_greedy():
    """SmolLM2-135M-Instruct from its GGUF: chunked prefill + decode vs the plain forward."""
    from replica.model.loader import load_checkpoint

    ckpt = load_checkpoint("default")
    cfg, w = ckpt.config, ckpt.weights
    engine = LLMEngine(EngineConfig(num_blocks=32, max_num_batched_tokens=16, max_num_seqs=4), cfg, w)
    ids = ckpt.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    engine.add(P.Generate(id="g", prompt_ids=ids, sampling=greedy(8)))
    seen = []

    def check(logits, toks):
        seen.extend(logits.values())

    toks, _ = run(engine, check)
    # One reference pass over prompt + output: row len(ids) - 1 + j predicts output token j.
    ref = reference_logits(cfg, w, ids + toks["g"][:-1])[len(ids) - 1:]
    assert len(seen) == len(ref) == 8
    assert (torch.stack(seen) - ref).abs().max() < 1e-4
    assert ckpt.tokenizer.decode(toks["g"]) == "The capital of France is Paris."


def test_token_budget_beside_decodes_and_alone():
    """A step without decodes takes prompts in prefill_only_tokens chunks (no stream waits
    on it); beside decodes the budget holds, stretched so prefill keeps half of it."""
    engine, _, _ = make_engine(max_num_batched_tokens=8, max_num_seqs=8, prefill_only_tokens=40)
    sched = engine.scheduler
    for rid, ids in prompts([60] + [3] * 6, seed=5).items():
        assert engine.add(P.Generate(id=rid, prompt_ids=ids, sampling=greedy(32))) is None
    first = sched.schedule()  # nothing decodes yet: 40 tokens, all of them s0's
    assert first.num_tokens == [40] and first.num_decodes == 0
    engine.abort("s0")
    for _ in range(12):  # s1..s6 prefill (8 tokens a step), then decode
        engine.step()
    assert sum(s.is_decode for s in sched.running) == 6
    assert engine.add(P.Generate(id="late", prompt_ids=prompts([30], seed=6)["s0"], sampling=greedy(4))) is None
    batch = sched.schedule()  # 6 decodes: max(8, 6 + 8 // 2) = 10 tokens, the late prompt gets 4
    assert batch.num_decodes == 6 and batch.num_tokens[6:] == [4]


def test_load_reports_every_steps_time():
    """Load.step_counts / step_seconds (a replica's edgechat_replica_step_seconds histogram): each step in the
    bucket of the first bound at or above its time, the seconds summed, from the engine's start."""
    engine, _, _ = make_engine(max_num_batched_tokens=64)
    load = engine.load()
    assert load.step_counts == [0] * (len(P.STEP_BUCKETS_S) + 1) and load.step_seconds == 0.0
    engine.add(P.Generate(id="a", prompt_ids=prompts([20])["s0"], sampling=greedy(5)))
    t0 = time.perf_counter()
    run(engine)
    elapsed = time.perf_counter() - t0
    load = engine.load()
    assert sum(load.step_counts) == engine.stats.steps >= 5
    assert 0.0 < load.step_seconds <= elapsed
    # the slowest step is in a bucket whose bound is at least the mean step
    slowest = max(i for i, n in enumerate(load.step_counts) if n)
    bounds = [*P.STEP_BUCKETS_S, float("inf")]
    assert bounds[slowest] >= load.step_seconds / engine.stats.steps


def test_load_counts_the_conversations_it_holds_and_the_new_ones_it_has():
    """Load.chains: the chains cached (wire.hashing.ChainTips), and the requests that start a conversation
    (Generate.new_chain) from the moment the engine has them: waiting, then prefilling, then cached as a
    chain, counted once throughout; a later turn that extends its conversation adds none."""
    engine, _, _ = make_engine(max_num_seqs=1, max_num_batched_tokens=24)  # one at a time, 24-token chunks
    assert engine.load().chains == 0
    a, b = prompts([60, 60])["s0"], [7] * 60
    engine.add(P.Generate(id="a", prompt_ids=a, sampling=greedy(4), new_chain=True))
    engine.add(P.Generate(id="b", prompt_ids=b, sampling=greedy(4), new_chain=True))
    assert engine.load().chains == 2  # both waiting
    engine.step()  # a's first chunk: its first blocks are cached, b waits
    assert engine.load().chains == 2
    toks, _ = run(engine)
    assert engine.load().chains == 2 and not engine.new_chains
    reply = toks["a"] + [5] * 30  # (a longer reply, so that its blocks fill past the prompt's)
    engine.add(P.Generate(id="a1", prompt_ids=a + reply, sampling=greedy(1)))
    run(engine)
    assert engine.load().chains == 2  # a's blocks, extended
    engine.add(P.Generate(id="a2", prompt_ids=a + reply + [9] * 40, sampling=greedy(4)))  # its next turn
    run(engine)
    assert engine.load().chains == 2
    engine.add(P.Generate(id="c", prompt_ids=a[:32] + [8] * 40, sampling=greedy(4), new_chain=True))  # a branch
    run(engine)
    assert engine.load().chains == 3


def test_load_reports_the_measured_prefill_rate():
    """Load.tokens_per_s: prompt tokens per second on steps that prefill at least
    PREFILL_RATE_MIN_TOKENS (the proxy prices queued prefill and spills with it)."""
    from replica.engine.llm_engine import PREFILL_RATE_MIN_TOKENS

    engine, _, _ = make_engine(max_num_batched_tokens=64)
    assert engine.load().tokens_per_s == 0.0  # nothing measured yet: not reported
    engine.add(P.Generate(id="d", prompt_ids=prompts([8])["s0"], sampling=greedy(4)))
    run(engine)
    assert engine.load().tokens_per_s == 0.0  # a short prompt's step is mostly fixed cost: not a rate
    engine.add(P.Generate(id="p", prompt_ids=prompts([4 * PREFILL_RATE_MIN_TOKENS])["s0"], sampling=greedy(2)))
    t0 = time.perf_counter()
    run(engine)
    elapsed = time.perf_counter() - t0
    rate = engine.load().tokens_per_s
    assert rate >= 2 * PREFILL_RATE_MIN_TOKENS / elapsed  # two 64-token steps, each at most the whole run


def test_default_engine_prefills_long_prompts_on_int8_activations(tmp_path, monkeypatch):
    """prefill_activations "auto" (the default) calibrates at start from the tokenizer and keeps
    the calibration beside the built model (a later start needs no tokenizer); then a prompt of
    128 tokens or more prefills its rows but the last on int8 activations (its first token's
    logits move a little against int16's), and a shorter one stays int16, bit for bit."""
    from replica.model.loader import load_checkpoint

    monkeypatch.setenv("EDGECHAT_BUILT_DIR", str(tmp_path))
    ckpt = load_checkpoint("default")
    cfg, w, tok = ckpt.config, ckpt.weights, ckpt.tokenizer
    kw = dict(num_blocks=64, max_num_batched_tokens=512, max_num_seqs=4, quantization="gguf")
    assert LLMEngine(EngineConfig(**kw), cfg, w).runner.narrow_from is None  # nothing to calibrate on: int16
    with pytest.raises(ValueError, match="tokenizer"):
        LLMEngine(EngineConfig(prefill_activations="int8", **kw), cfg, w)
    auto = LLMEngine(EngineConfig(**kw), cfg, w, tokenizer=tok)
    exact = LLMEngine(EngineConfig(prefill_activations="int16", **kw), cfg, w, tokenizer=tok)
    assert auto.runner.narrow_from == 128 and exact.runner.narrow_from is None
    assert len(list(tmp_path.glob("*.outliers.json"))) == 1
    kept = LLMEngine(EngineConfig(**kw), cfg, w)  # the kept calibration, no tokenizer
    assert kept.runner.narrow_from == 128
    # (each engine's first prompt: the two share the chat template's first tokens, and a cached
    # prefix keeps the KV of whichever prompt computed it)
    story = " ".join(["The lighthouse keeper wrote the day's weather, the ships that passed and the birds."] * 8)
    short, long = (tok.encode_chat([{"role": "user", "content": c}]) for c in ("What is 2 + 2?", story))
    assert len(short) < 128 <= len(long)

    def first_logits(engine, ids):
        seen = []
        engine.add(P.Generate(id="x", prompt_ids=ids, sampling=greedy(1)))
        run(engine, lambda logits, toks: seen.extend(logits.values()))
        return seen[0]

    assert torch.equal(first_logits(auto, short), first_logits(exact, short))
    a, b = first_logits(kept, long), first_logits(exact, long)
    assert 0 < (a - b).abs().max() < 0.05 * b.abs().max()
    again = LLMEngine(EngineConfig(**kw), cfg, w, tokenizer=tok)  # calibrated as `kept` was
    assert torch.equal(first_logits(again, long), a)


def test_decode_rows_on_int8_activations_move_the_decode_logits_only(tmp_path, monkeypatch):
    """decode_activations "int8" (opt-in) rounds the plain decode rows' matmul inputs to int8 as
    it does long prompts' rows: the first token's logits (a prompt's last row, int16) are those of
    an int16 engine bit for bit, the next ones (decode rows, two in a step) move a little."""
    from replica.model.loader import load_checkpoint

    monkeypatch.setenv("EDGECHAT_BUILT_DIR", str(tmp_path))
    ckpt = load_checkpoint("default")
    cfg, w, tok = ckpt.config, ckpt.weights, ckpt.tokenizer
    kw = dict(num_blocks=64, max_num_batched_tokens=512, max_num_seqs=4, quantization="gguf")
    with pytest.raises(ValueError, match="tokenizer"):
        LLMEngine(EngineConfig(decode_activations="int8", **kw), cfg, w)
    with pytest.raises(ValueError, match="decode_activations"):
        EngineConfig(decode_activations="int4", **kw)
    int8 = LLMEngine(EngineConfig(decode_activations="int8", **kw), cfg, w, tokenizer=tok)
    int16 = LLMEngine(EngineConfig(**kw), cfg, w, tokenizer=tok)
    assert int8.runner.narrow_decodes and not int16.runner.narrow_decodes
    asks = [tok.encode_chat([{"role": "user", "content": c}]) for c in ("What is 2 + 2?", "Name a colour.")]
    assert all(len(a) < 128 for a in asks)  # prompts every row of which stays int16 under "auto"

    def logits_by_step(engine):
        for i, ids in enumerate(asks):
            engine.add(P.Generate(id=str(i), prompt_ids=ids, sampling=greedy(2)))
        steps = []
        run(engine, lambda logits, toks: steps.append(dict(logits)))
        return steps

    a, b = logits_by_step(int8), logits_by_step(int16)
    assert len(a) == len(b) == 2 and set(a[1]) == {"0", "1"}  # one prefill step, then one step of two decodes
    for i in ("0", "1"):
        assert torch.equal(a[0][i], b[0][i])
        assert a[0][i].argmax() == b[0][i].argmax()  # the decodes' input token is the same
        assert 0 < (a[1][i] - b[1][i]).abs().max() < 0.05 * b[1][i].abs().max()
