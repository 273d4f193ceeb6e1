"""Overlap scheduling (step N+1 planned and launched before step N's tokens are
read back) must not change a single token, finish reason or usage figure."""

import pytest

from wire import protocol as P
from tests.replica.engines import make_engine, prompts
from tests.replica.tiny import tiny_config


def run_all(engine, abort_at=None):
    """Step until idle; {id: (tokens, finish reason, usage)}."""
    toks, fins, steps = {}, {}, 0
    while engine.has_work():
        out = engine.step()
        steps += 1
        if abort_at and steps == abort_at[1]:
            fin = engine.abort(abort_at[0])
            if fin is not None:
                out.append(fin)
        for m in out:
            toks.setdefault(m.id, []).extend(m.ids)
            if isinstance(m, P.Finished):
                fins[m.id] = (m.finish_reason, m.usage)
    engine.blocks.check_invariants()
    assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.seqs
    assert all(s == 0 for s in engine.blocks.ref_count)
    return {k: (toks.get(k, []), fins[k]) for k in fins}


def workload(engine, eos_first=None):
    ps = prompts([5, 40, 17, 33, 16, 3], seed=4)
    kinds = [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=11), dict(temperature=1.0, top_k=5, seed=2)]
    for i, (k, ids) in enumerate(ps.items()):
        sp = P.SamplingParams(max_tokens=6 + 3 * i, ignore_eos=eos_first is None, **kinds[i % 3])
        assert engine.add(P.Generate(id=k, prompt_ids=ids, sampling=sp)) is None


@pytest.mark.parametrize("kw", [
    {},
    {"num_blocks": 10},  # preemption by recompute
    {"graph_mode": "buffers"},  # placeholders resolved into the graph buffers
    {"max_model_len": 44},  # length limit of the context
])
def test_overlap_gives_identical_outputs(kw):
    outs = []
    for overlap in (False, True):
        engine, _, _ = make_engine(overlap=overlap, **kw)
        workload(engine)
        outs.append(run_all(engine))
    assert outs[0] == outs[1]
    assert len(outs[0]) == 6


def test_overlap_with_eos_stops_and_abort():
    cfg = tiny_config(eos_token_ids=tuple(range(1, 97, 5)))  # frequent EOS: finishes land mid-flight
    outs = []
    for overlap in (False, True):
        engine, _, _ = make_engine(cfg, overlap=overlap)
        workload(engine, eos_first=True)
        engine.add(P.Generate(id="victim", prompt_ids=[9] * 20, sampling=P.SamplingParams(max_tokens=50,
                                                                                          ignore_eos=True)))
        res = run_all(engine, abort_at=("victim", 3))
        assert res["victim"][1][0] == "abort"
        outs.append({k: v for k, v in res.items() if k != "victim"})
    assert outs[0] == outs[1]
    assert any(fin[0] == "stop" for _, fin in outs[0].values())
