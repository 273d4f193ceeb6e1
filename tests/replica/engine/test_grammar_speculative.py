"""Speculative decoding of constrained requests (tiny random target, 97-token
tokenizer): drafts the grammar refuses are cut before verification, every node is
verified against the mask of its own state, and the output is token for token the
output without speculation (greedy and seeded), next to free rows in the same steps."""

import json
import re

import pytest

from wire import protocol as P
from wire import structured as S
from speculative.drafting import DraftTree
from tests.replica import spec_engines
from tests.replica.grammars import CHOICES, REGEX, SCHEMA, prompt, text
from tests.replica.spec_engines import DRAFTERS
from tests.replica.tiny import tiny_tokenizer

jsonschema = pytest.importorskip("jsonschema")  # the test extra; a GPU image may lack it

NEWLINE = 96  # never valid in these grammars (compact JSON, the regex, the choices)


def engine(spec=None, head=None, **kw):
    """The speculating engine of test_speculative_engine (spec_engines: the same tiny target and
    head), with a tokenizer and room for JSON."""
    return spec_engines.engine(spec, head, tokenizer=tiny_tokenizer(), **{
        "num_blocks": 96, "max_num_batched_tokens": 64, **kw})


def requests(temperature: float = 0.0) -> dict:
    kw = dict(max_tokens=150, temperature=temperature, seed=7)
    return {"json": P.SamplingParams(grammar=S.json_schema_grammar(SCHEMA), **kw),
            "regex": P.SamplingParams(grammar=S.regex_grammar(REGEX), **kw),
            "choice": P.SamplingParams(grammar=S.choice_grammar(CHOICES), **kw),
            "free": P.SamplingParams(max_tokens=20, temperature=temperature, seed=3, ignore_eos=True)}


def run(eng, reqs: dict):
    for rid, sp in reqs.items():
        assert eng.add(P.Generate(id=rid, prompt_ids=prompt(rid), sampling=sp)) is None
    toks, fins = {}, {}
    while eng.has_work():
        for m in eng.step():
            assert not isinstance(m, P.Error), m
            toks.setdefault(m.id, []).extend(m.ids)
            if isinstance(m, P.Finished):
                fins[m.id] = m
    eng.blocks.check_invariants()
    assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.seqs
    return toks, fins


def valid(toks: dict) -> None:
    jsonschema.validate(json.loads(text(toks["json"])), SCHEMA)
    assert re.fullmatch(REGEX, text(toks["regex"])) and text(toks["choice"]) in CHOICES


class Oracle:
    """Knows each request's reference continuation; at every depth drafts a refused
    token (a newline) beside the right one, and gets every fifth position wrong."""

    def __init__(self, references: list[list[int]], depth: int = 4):
        self.refs, self.depth = references, depth

    @property
    def lookahead(self) -> int:
        return 2 * self.depth

    @property
    def k(self) -> int:  # draft tokens per tree, for the scheduler's budget
        return 2 * self.depth

    def propose(self, tokens) -> DraftTree:
        n = len(tokens)
        ref = next((r for r in self.refs if r[:n] == list(tokens)), None)
        toks, parents, node = [tokens[-1]], [-1], 0
        for d, t in enumerate(ref[n : n + self.depth] if ref else []):
            good = t if (n + d) % 5 else (t % 95) + 1
            toks += [NEWLINE, good]
            parents += [node, node]
            node = len(toks) - 1
        return DraftTree(toks, parents)


def spy_prune(eng) -> list[int]:
    """Counts the draft nodes the grammar cut (the engine's own prune does the work)."""
    cut, prune = [0], eng.grammars.prune

    def counting(seq, tree):
        kept = prune(seq, tree)
        cut[0] += len(tree) - len(kept)
        return kept
    eng.grammars.prune = counting
    return cut


@pytest.fixture(scope="module")
def baseline():
    return {t: run(engine(), requests(t))[0] for t in (0.0, 0.8)}


def test_refused_drafts_are_cut_and_accepted_paths_follow_the_grammar(baseline):
    base = baseline[0.0]
    valid(base)
    eng = engine("ngram")
    eng.speculator._specs = [None] + [Oracle([prompt(k) + v for k, v in base.items()])] * 16
    cut = spy_prune(eng)
    toks, fins = run(eng, requests())
    assert toks == base
    assert cut[0] > 20  # every constrained tree lost its newline drafts before verification
    assert fins["json"].usage.accepted_draft_tokens > 20 and fins["regex"].usage.accepted_draft_tokens > 0
    assert eng.stats.steps < sum(len(v) for v in base.values())  # several tokens per forward


@pytest.mark.parametrize("spec, temperature", [(spec, 0.0) for spec in DRAFTERS] + [("eagle3-tree", 0.8)])
def test_constrained_output_identical_with_speculation(spec, temperature, head_path, baseline):
    eng = engine(spec, head_path)
    cut = spy_prune(eng)
    toks, _ = run(eng, requests(temperature))
    assert toks == baseline[temperature]
    valid(toks)
    if spec != "ngram":  # a random head's drafts are mostly outside the grammar
        assert cut[0] > 0


def test_sampled_drafts_stay_in_the_grammar(head_path):
    """Sampled EAGLE-3 chains (rejection sampling against the masked distribution):
    lossless rather than identical, and every answer valid."""
    eng = engine("eagle3-chain", head_path, spec_sample=True)
    toks, fins = run(eng, requests(0.8))
    valid(toks)
    assert all(fins[k].finish_reason == "stop" for k in ("json", "regex", "choice"))
