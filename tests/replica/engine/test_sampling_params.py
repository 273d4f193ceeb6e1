"""The engine honours issue 12's sampling parameters on a tiny random Llama, each
checked against the plain reference forward with the documented formula applied
on the host: logit_bias, repetition/frequency/presence penalties, min_p, min_tokens,
logprobs and prompt logprobs; n samples share one prefill; a resumed seeded request
with penalties continues exactly; overlap scheduling and speculation change nothing."""

from __future__ import annotations

import math

import pytest
import torch

from replica.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from tests.replica.engines import make_engine, prompts
from tests.replica.reference import reference_logits
from tests.replica.tiny import tiny_config, tiny_weights
from wire import protocol as P


def sp(**kw) -> P.SamplingParams:
    base = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
    base.update(kw)
    return P.SamplingParams(**base)


def processed_ref(logits: torch.Tensor, prompt: list[int], out: list[int], s: P.SamplingParams,
                  eos=(0,)) -> torch.Tensor:
    """The module docstring's formula, written out on the host."""
    x = logits.clone().double()
    for t, b in s.logit_bias.items():
        x[t] += b
    r = s.repetition_penalty
    for t in set(prompt + out):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t in set(out):
        x[t] -= s.frequency_penalty * out.count(t) + s.presence_penalty
    if len(out) < s.min_tokens:
        for t in set(() if s.ignore_eos else eos) | set(s.stop_token_ids):
            x[t] = -math.inf
    if s.min_p and s.temperature > 0:
        x[x < x.max() + s.temperature * math.log(s.min_p)] = -math.inf
    return x


def generate(engine, reqs: dict[str, tuple[list[int], P.SamplingParams]], **gen_kw):
    for k, (ids, s) in reqs.items():
        assert engine.add(P.Generate(id=k, prompt_ids=ids, sampling=s, **gen_kw.get(k, {}))) is None
    toks, fins, msgs = {}, {}, {}
    while engine.has_work():
        for m in engine.step():
            toks.setdefault(m.id, []).extend(m.ids)
            msgs.setdefault(m.id, []).append(m)
            if isinstance(m, P.Finished):
                fins[m.id] = m
    engine.blocks.check_invariants()
    return toks, fins, msgs


PENALTIES = [
    dict(logit_bias={7: 100.0}),
    dict(repetition_penalty=1.8),
    dict(frequency_penalty=1.5, presence_penalty=0.7),
    dict(repetition_penalty=0.6, frequency_penalty=-1.0, logit_bias={3: 2.5, 11: -4.0}),
    dict(min_tokens=6, ignore_eos=False, stop_token_ids=[5, 9]),
]


@pytest.mark.parametrize("params", PENALTIES)
def test_greedy_with_processing_follows_the_formula_on_reference_logits(params):
    engine, cfg, w = make_engine()
    ps = prompts([5, 21, 40], seed=3)
    reqs = {k: (ids, sp(**params)) for k, ids in ps.items()}
    reqs["plain"] = (ps["s1"], sp())  # a bystander in the same batches
    toks, fins, _ = generate(engine, reqs)
    for k, ids in ps.items():
        s = reqs[k][1]
        for i, tok in enumerate(toks[k]):
            ref = processed_ref(reference_logits(cfg, w, ids + toks[k][:i])[-1], ids, toks[k][:i], s)
            top2 = ref.topk(2).values
            assert tok == int(ref.argmax()) or top2[0] - top2[1] < 1e-4, (k, i)
    if "logit_bias" in params and 7 in params["logit_bias"]:
        assert all(t == 7 for k in ps for t in toks[k])
    if params.get("min_tokens"):
        for k in ps:
            assert not set(toks[k][:6]) & {0, 5, 9}
    plain_alone, _, _ = generate(make_engine()[0], {"plain": (ps["s1"], sp())})
    assert toks["plain"] == plain_alone["plain"]


def test_penalties_change_a_repetitive_output():
    engine, _, _ = make_engine()
    ids = prompts([12], seed=4)["s0"] * 3
    base, _, _ = generate(engine, {"a": (ids, sp(max_tokens=24))})
    pen, _, _ = generate(engine, {"b": (ids, sp(max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0))})
    assert len(set(pen["b"])) > len(set(base["a"]))


def test_min_p_keeps_only_likely_tokens():
    engine, cfg, w = make_engine()
    ids = prompts([9], seed=5)["s0"]
    reqs = {f"m{i}": (ids, sp(temperature=1.5, seed=i, min_p=0.3, max_tokens=6)) for i in range(8)}
    toks, _, _ = generate(engine, reqs)
    for k, out in toks.items():
        for i, tok in enumerate(out):
            p = torch.softmax(reference_logits(cfg, w, ids + out[:i])[-1].double() / 1.5, -1)
            assert p[tok] >= 0.3 * p.max() - 1e-6
    assert len({tuple(t) for t in toks.values()}) > 1  # still sampling


@pytest.mark.parametrize("overlap", [False, True])
def test_logprobs_are_the_raw_log_softmax_and_its_top_k(overlap):
    engine, cfg, w = make_engine(overlap=overlap)
    ps = prompts([7, 30], seed=6)
    reqs = {"lp": (ps["s0"], sp(logprobs=3, temperature=0.9, seed=1, repetition_penalty=1.3)),
            "lp0": (ps["s1"], sp(logprobs=0)), "none": (ps["s1"], sp())}
    toks, fins, msgs = generate(engine, reqs)
    for k in ("lp", "lp0"):
        recs = [r for m in msgs[k] for r in m.logprobs]
        assert len(recs) == len(toks[k]) == 10
        for i, (tok, rec) in enumerate(zip(toks[k], recs)):
            ref = torch.log_softmax(reference_logits(cfg, w, reqs[k][0] + toks[k][:i])[-1].double(), -1)
            assert abs(rec.logprob - ref[tok].item()) < 1e-4
            kk = reqs[k][1].logprobs
            assert len(rec.top_ids) == kk and len(rec.top_logprobs) == kk
            assert rec.top_ids == ref.topk(kk).indices.tolist() if kk else rec.top_ids == []
            assert all(abs(a - ref[t].item()) < 1e-4 for a, t in zip(rec.top_logprobs, rec.top_ids))
    assert all(not m.logprobs for m in msgs["none"])


def test_prompt_logprobs_once_even_when_preempted_and_never_from_the_cache():
    engine, cfg, w = make_engine(num_blocks=12, max_num_batched_tokens=16)
    ids = prompts([70], seed=7)["s0"]
    generate(engine, {"warm": (ids, sp(max_tokens=2))})  # its blocks are cached now
    reqs = {"echo": (ids, sp(prompt_logprobs=2, max_tokens=30)),
            "other": (prompts([60], seed=8)["s0"], sp(max_tokens=40))}  # squeezes the pool: preemptions
    toks, fins, msgs = generate(engine, reqs)
    assert engine.scheduler.num_preemptions > 0
    got = [r for m in msgs["echo"] for r in m.prompt_logprobs]
    assert len(got) == len(ids) - 1 and sum(1 for m in msgs["echo"] if m.prompt_logprobs) == 1
    ref = torch.log_softmax(reference_logits(cfg, w, ids).double(), -1)
    for j, rec in enumerate(got):
        assert abs(rec.logprob - ref[j, ids[j + 1]].item()) < 1e-4
        assert rec.top_ids == ref[j].topk(2).indices.tolist()
    assert fins["echo"].usage.cached_tokens == 0


def test_n_samples_share_one_prefill():
    engine, _, _ = make_engine(num_blocks=64, max_num_batched_tokens=64)
    ids = prompts([53], seed=9)["s0"]
    samples = {f"x{i}": (ids, sp(temperature=1.0, seed=P.sample_seed(42, i), max_tokens=6)) for i in range(3)}
    computed = []
    engine.scheduler.schedule = _counting(engine.scheduler.schedule, computed)
    toks, fins, _ = generate(engine, samples, x1={"fork_of": "x0"}, x2={"fork_of": "x0"})
    bs = engine.cfg.block_size
    shared = (len(ids) - 1) // bs * bs  # full blocks of the prompt, reused by the other samples
    prefill = sum(computed) - sum(len(t) - 1 for t in toks.values())
    assert prefill == len(ids) + 2 * (len(ids) - shared)
    assert [fins[f"x{i}"].usage.cached_tokens for i in (1, 2)] == [shared, shared]
    assert len({tuple(t) for t in toks.values()}) == 3
    alone, _, _ = generate(make_engine()[0], {"x2": samples["x2"]})  # a sample is its seed's stream
    assert alone["x2"] == toks["x2"]


def _counting(schedule, computed: list):
    def wrapped():
        batch = schedule()
        computed.append(sum(batch.num_tokens))
        return batch
    return wrapped


def test_aborting_a_parked_sample_and_its_leader():
    engine, _, _ = make_engine()
    ids = prompts([40], seed=10)["s0"]
    generate_reqs = {"l": (ids, sp()), "f": (ids, sp(seed=3, temperature=1.0))}
    for k, (p, s) in generate_reqs.items():
        engine.add(P.Generate(id=k, prompt_ids=p, sampling=s, fork_of="l" if k == "f" else ""))
    assert len(engine.forks) == 1
    assert engine.abort("f").finish_reason == "abort" and len(engine.forks) == 0
    engine.add(P.Generate(id="f2", prompt_ids=ids, sampling=sp(), fork_of="l"))
    engine.abort("l")  # the leader goes: its sample starts on its own
    toks, fins, _ = generate(engine, {})
    assert len(toks["f2"]) == 10 and engine.blocks.num_free == engine.blocks.num_blocks


def test_resume_with_penalties_continues_exactly():
    engine, _, _ = make_engine()
    ids = prompts([20], seed=11)["s0"]
    s = sp(temperature=0.8, seed=5, max_tokens=16, frequency_penalty=1.0, repetition_penalty=1.4,
           logit_bias={4: 1.5}, min_p=0.05)
    whole, _, _ = generate(engine, {"w": (ids, s)})
    cut = 6
    rest, _, _ = generate(engine, {"r": (ids, s)}, r={"resume_ids": whole["w"][:cut]})
    assert rest["r"] == whole["w"][cut:]


def test_overlap_scheduling_gives_the_same_tokens_with_penalties():
    reqs = {k: (ids, sp(temperature=0.7, seed=i, frequency_penalty=1.2, repetition_penalty=1.3, max_tokens=12))
            for i, (k, ids) in enumerate(prompts([6, 25, 13], seed=12).items())}
    plain, _, _ = generate(make_engine(overlap=False)[0], reqs)
    over, _, _ = generate(make_engine(overlap=True)[0], reqs)
    assert plain == over


def test_processed_requests_decode_plainly_under_speculation():
    cfg = tiny_config()
    w = tiny_weights(cfg)
    ids = (prompts([8], seed=13)["s0"] * 4)
    reqs = {"pen": (ids, sp(max_tokens=14, repetition_penalty=1.5, logprobs=1)), "plain": (ids, sp(max_tokens=14))}
    base, _, bm = generate(LLMEngine(EngineConfig(num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4), cfg, w),
                           reqs)
    spec_engine = LLMEngine(EngineConfig(num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4,
                                         speculative="ngram", spec_depth=4), cfg, w)
    got, _, gm = generate(spec_engine, reqs)
    assert got == base
    assert [len(m.logprobs) for m in gm["pen"]] == [len(m.ids) for m in gm["pen"]]


def test_bad_params_are_named():
    engine, _, _ = make_engine()
    for s, word in [(sp(logit_bias={500: 1.0}), "logit_bias"), (sp(min_tokens=20), "min_tokens"),
                    (sp(repetition_penalty=0.0), "repetition_penalty"), (sp(logprobs=99), "logprobs"),
                    (sp(stop_token_ids=[97]), "stop_token_ids"), (sp(n=2), "n"),
                    (sp(presence_penalty=float("nan")), "presence_penalty")]:
        err = engine.add(P.Generate(id="bad", prompt_ids=[1, 2], sampling=s))
        assert err is not None and err.message.startswith(word), (word, err)
