"""Structured output inside the engine (tiny random Llama, a 97-token byte-level
tokenizer): constrained and free rows in one step, masks applied before sampling,
grammar state through overlap, preemption and resume, compile errors and aborts."""

import json
import re

import pytest

from wire import protocol as P
from wire import structured as S
from replica.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from tests.replica.grammars import CHOICES, REGEX, SCHEMA, prompt, text
from tests.replica.tiny import tiny_config, tiny_tokenizer, tiny_weights

jsonschema = pytest.importorskip("jsonschema")  # the test extra; a GPU image may lack it


def make(tokenizer=True, **kw):
    cfg = tiny_config()
    ecfg = dict(num_blocks=64, block_size=16, max_num_batched_tokens=32, max_num_seqs=8)
    ecfg.update(kw)
    return LLMEngine(EngineConfig(**ecfg), cfg, tiny_weights(cfg), tokenizer=tiny_tokenizer() if tokenizer else None)


def constrained(max_tokens=160, **kw):
    return {
        "json": P.SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=S.json_schema_grammar(SCHEMA), **kw),
        "regex": P.SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=S.regex_grammar(REGEX), **kw),
        "choice": P.SamplingParams(max_tokens=max_tokens, temperature=0.0, grammar=S.choice_grammar(CHOICES), **kw),
        "hot": P.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=5, grammar=S.json_schema_grammar(SCHEMA),
                                **kw),
    }


def free(n: int = 3) -> dict:
    return {f"free{i}": P.SamplingParams(max_tokens=12 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(n)}


def run(engine, requests: dict, abort_at=None):
    """Add every request (id -> SamplingParams) with its prompt, step until idle:
    {id: (text ids, finish reason)} and the per-step (constrained rows, sampled rows)."""
    for rid, sp in requests.items():
        assert engine.add(P.Generate(id=rid, prompt_ids=prompt(rid), sampling=sp)) is None
    rows, execute = [], engine.runner.execute

    def spy(plan, prev_tokens=None, seqs=None, constrain=None):  # records what each step samples
        seqs = seqs or []
        rows.append((sum(s.grammar is not None for s in seqs), len(seqs)))
        return execute(plan, prev_tokens, seqs, constrain)

    engine.runner.execute = spy
    toks, fins, steps = {}, {}, 0
    while engine.has_work():
        out = engine.step()
        steps += 1
        if abort_at is not None and steps == abort_at[1]:
            out.append(engine.abort(abort_at[0]))
        for m in out:
            if isinstance(m, P.Error):
                fins[m.id] = ("error", m.message)
                continue
            toks.setdefault(m.id, []).extend(m.ids)
            if isinstance(m, P.Finished):
                fins[m.id] = m.finish_reason
    engine.blocks.check_invariants()
    assert not engine.seqs and engine.blocks.num_free == engine.blocks.num_blocks
    return {k: (toks.get(k, []), fins[k]) for k in fins}, rows


def check_constrained(res: dict) -> None:
    for rid in ("json", "hot"):
        doc = json.loads(text(res[rid][0]))
        jsonschema.validate(doc, SCHEMA)
        assert res[rid][1] == "stop"
    assert re.fullmatch(REGEX, text(res["regex"][0])) and res["regex"][1] == "stop"
    assert text(res["choice"][0]) in CHOICES and res["choice"][1] == "stop"


def test_constrained_and_free_rows_in_one_step():
    res, rows = run(make(), {**constrained(), **free()})
    check_constrained(res)
    assert any(0 < c < n for c, n in rows), "some step mixed constrained and free rows"
    alone, _ = run(make(), free())
    assert {k: v for k, v in res.items() if k.startswith("free")} == alone  # free rows are untouched
    # The same model without the grammar writes something else: the mask is what made it valid.
    unconstrained, _ = run(make(), {"json": P.SamplingParams(max_tokens=20, temperature=0.0)})
    with pytest.raises(ValueError):
        json.loads(text(unconstrained["json"][0]))


@pytest.mark.parametrize("kw", [{"overlap": True}, {"num_blocks": 12}, {"num_blocks": 12, "overlap": True}])
def test_overlap_and_preemption_keep_constrained_outputs(kw):
    reqs = {**constrained(), **free()}
    base, _ = run(make(), reqs)
    engine = make(**kw)
    res, _ = run(engine, reqs)
    assert res == base
    if kw.get("num_blocks"):
        assert engine.scheduler.num_preemptions > 0


def test_resume_restores_the_grammar_state_from_the_tokens():
    full, _ = run(make(), {"json": constrained()["json"]})
    ids = full["json"][0]
    ps = prompt("json")
    for k in (1, len(ids) // 2, len(ids) - 1):
        engine = make()
        assert engine.add(P.Generate(id="json", prompt_ids=ps, sampling=constrained()["json"],
                                     resume_ids=ids[:k])) is None
        rest, _ = run(engine, {})
        assert ids[:k] + rest["json"][0] == ids and rest["json"][1] == "stop"
    engine = make()  # tokens the grammar never allowed: refused, not continued
    engine.add(P.Generate(id="json", prompt_ids=ps, sampling=constrained()["json"], resume_ids=[5, 6]))
    res, _ = run(engine, {})
    assert res["json"][1][0] == "error" and "grammar" in res["json"][1][1]


def test_compile_errors_and_aborts_while_compiling():
    engine = make()
    bad = P.SamplingParams(grammar='{"grammars": [{"lark_grammar": "start: nope"}]}')
    assert engine.add(P.Generate(id="bad", prompt_ids=[1, 2], sampling=bad)) is None
    res, _ = run(engine, {"ok": constrained()["regex"], "gone": constrained()["choice"]}, abort_at=("gone", 1))
    assert res["bad"][1][0] == "error" and "nope" in res["bad"][1][1]
    assert res["gone"][1] == "abort" and re.fullmatch(REGEX, text(res["ok"][0]))
    res, _ = run(make(tokenizer=False), {"x": constrained()["regex"]})
    assert res["x"][1][0] == "error" and "tokenizer" in res["x"][1][1]


def test_compiled_once_per_grammar():
    engine = make()
    g = constrained()["json"].grammar
    assert engine.grammars.compile(g) is engine.grammars.compile(g)
    res, _ = run(engine, {f"r{i}": constrained()["json"] for i in range(4)})
    assert len(engine.grammars._cache) == 1
    for ids, reason in res.values():
        jsonschema.validate(json.loads(text(ids)), SCHEMA)
