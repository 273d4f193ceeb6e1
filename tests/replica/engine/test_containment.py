"""Crash containment on the real engine (tiny random Llama): a request that makes a
step raise fails alone with `engine_fault`, its batch-mates finish token for token
as they would have alone, every block comes back; a transient failure fails nobody;
an engine that fails whatever runs is declared broken.

The poison is the original query of death: a sequence whose top_k does not fit the
int32 tensor it becomes (put past validation, which now rejects it at the door)."""

import pytest

from wire import protocol as P
from replica.engine.containment import Containment, EngineBroken
from tests.replica.engines import make_engine, prompts

KINDS = [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=11), dict(temperature=1.0, top_k=5, seed=2)]


def add_all(engine, ids: dict):
    for i, (k, p) in enumerate(ids.items()):
        sp = P.SamplingParams(max_tokens=8 + i, ignore_eos=True, **KINDS[i % 3])
        assert engine.add(P.Generate(id=k, prompt_ids=p, sampling=sp)) is None


def poison(engine, rid: str) -> None:
    engine.seqs[rid].sampling.top_k = 2**31  # past validation: the sampler's int32 tensor overflows


def drive(engine, contained: Containment, poison_at: dict | None = None):
    """Step until idle through containment; {id: ids}, {id: final message}. poison_at: {id: step}."""
    toks, final, step = {}, {}, 0
    while engine.has_work():
        step += 1
        for rid, at in (poison_at or {}).items():
            if at == step:
                poison(engine, rid)
        for m in contained.step():
            if isinstance(m, (P.Tokens, P.Finished)):
                toks.setdefault(m.id, []).extend(m.ids)
            if isinstance(m, (P.Finished, P.Error)):
                assert m.id not in final, f"{m.id} answered twice"
                final[m.id] = m
    engine.blocks.check_invariants()
    assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.seqs
    return toks, final


def alone(ids: dict, **kw) -> dict:
    """Each request served by itself on a fresh engine."""
    out = {}
    for i, (k, p) in enumerate(ids.items()):
        engine, _, _ = make_engine(**kw)
        sp = P.SamplingParams(max_tokens=8 + i, ignore_eos=True, **KINDS[i % 3])
        engine.add(P.Generate(id=k, prompt_ids=p, sampling=sp))
        toks, _ = drive(engine, Containment(engine))
        out[k] = toks[k]
    return out


@pytest.mark.parametrize("kw, poison_step", [
    ({}, 1),  # poisoned before its first token: fails at its first sample
    ({}, 4),  # poisoned mid-decode: the batch-mates have sent tokens already
    ({"overlap": True}, 4),  # a step in flight when it fails: its unread tokens are dropped, then recomputed
    ({"num_blocks": 10}, 3),  # preemption by recompute around the search
    ({"speculative": "ngram", "spec_depth": 3}, 4),  # a speculating step
])
def test_the_poisoned_request_fails_alone_and_the_rest_finish_exactly(kw, poison_step):
    ids = prompts([5, 40, 17, 33, 16, 3], seed=4)
    want = alone(ids, **kw)
    engine, _, _ = make_engine(**kw)
    add_all(engine, ids)
    bad = prompts([9], seed=8)["s0"]
    engine.add(P.Generate(id="bad", prompt_ids=bad, sampling=P.SamplingParams(max_tokens=30, temperature=0.7,
                                                                                 seed=5, ignore_eos=True)))
    contained = Containment(engine)
    toks, final = drive(engine, contained, {"bad": poison_step})
    assert final["bad"].code == P.ENGINE_FAULT and "int32" in final["bad"].message
    assert contained.num_faults == 1
    for k in ids:
        assert isinstance(final[k], P.Finished) and final[k].finish_reason == "length", k
        assert toks[k] == want[k], k


def test_two_poisoned_requests_are_both_found():
    ids = prompts([5, 40, 17, 33, 16, 3, 7], seed=1)
    engine, _, _ = make_engine()
    add_all(engine, ids)
    contained = Containment(engine)
    toks, final = drive(engine, contained, {"s1": 3, "s5": 3})
    assert {k for k, m in final.items() if isinstance(m, P.Error)} == {"s1", "s5"}
    assert all(isinstance(final[k], P.Finished) for k in ids if k not in ("s1", "s5"))


def test_a_poisoned_leader_releases_its_samples():
    """n > 1: samples 1 and 2 wait for sample 0's prefill (replica.engine.forks); sample 0 fails, they run."""
    engine, _, _ = make_engine()
    ids = prompts([40], seed=6)["s0"]
    for k in ("x0", "x1", "x2"):
        sp = P.SamplingParams(max_tokens=6, temperature=0.8, seed=int(k[1]), ignore_eos=True)
        assert engine.add(P.Generate(id=k, prompt_ids=ids, sampling=sp, fork_of="" if k == "x0" else "x0")) is None
    assert len(engine.forks) == 2
    toks, final = drive(engine, Containment(engine), {"x0": 1})
    assert final["x0"].code == P.ENGINE_FAULT
    assert all(isinstance(final[k], P.Finished) and len(toks[k]) == 6 for k in ("x1", "x2"))
    assert len(engine.forks) == 0


def test_a_transient_failure_fails_nobody(monkeypatch):
    ids = prompts([5, 40, 17, 33], seed=2)
    want = alone(ids)
    engine, _, _ = make_engine()
    add_all(engine, ids)
    real, calls = engine.runner.execute, [0]

    def flaky(*a, **kw):  # the third forward of the run fails once
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("transient device hiccup")
        return real(*a, **kw)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    contained = Containment(engine)
    toks, final = drive(engine, contained)
    assert all(isinstance(m, P.Finished) for m in final.values()) and contained.num_faults == 0
    assert toks == want


def test_an_engine_that_fails_whatever_runs_is_broken(monkeypatch):
    engine, _, _ = make_engine()
    add_all(engine, prompts([5, 6, 7], seed=3))

    def broken(*a, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine.runner, "execute", broken)
    with pytest.raises(EngineBroken, match="engine, not a request"):
        Containment(engine).step()


def test_a_failure_while_adding_fails_that_request_only(monkeypatch):
    engine, _, _ = make_engine()
    contained = Containment(engine)
    real = engine.scheduler.add

    def refuse(seq):
        if seq.id == "bad":
            raise MemoryError("no room for it")
        real(seq)

    monkeypatch.setattr(engine.scheduler, "add", refuse)
    err = contained.add(P.Generate(id="bad", prompt_ids=[1, 2, 3]))
    assert err.code == P.ENGINE_FAULT and err.id == "bad" and "bad" not in engine.seqs
    assert contained.add(P.Generate(id="ok", prompt_ids=[1, 2, 3], sampling=P.SamplingParams(max_tokens=3))) is None
    toks, final = drive(engine, contained)
    assert len(toks["ok"]) == 3


@pytest.mark.parametrize("field, value, problem", [
    ("top_k", 2**31, "top_k"), ("top_k", 2**63, "top_k"), ("seed", 2**64 - 1, "seed"),
    ("temperature", float("nan"), "temperature"), ("top_p", float("inf"), "top_p"),
    ("stop_token_ids", [2**40], "stop_token_ids"),
])
def test_validation_rejects_what_would_not_fit_its_tensor(field, value, problem):
    engine, _, _ = make_engine()
    sp = P.SamplingParams(max_tokens=4, temperature=0.5, seed=1)
    setattr(sp, field, value)
    err = engine.add(P.Generate(id="a", prompt_ids=[1, 2], sampling=sp))
    assert isinstance(err, P.Error) and err.code == P.BAD_REQUEST and problem in err.message
    assert not engine.has_work()
