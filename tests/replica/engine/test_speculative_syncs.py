"""A speculative step reads the host once: the accepted lengths and the tokens to stream.

What counts (tests/replica/sync_count.py): inside one speculative step (draft, verify,
accept, KV moves, the head's features, emitting), every tensor turned into Python data
(tolist, item, bool, int, ...), every blocking copy (a tensor built from Python data with
device=, a host-made tensor meeting a device tensor, a blocking .to of one, a Python list
as an index) and every op whose output size depends on the data. Host data the host owns
(block tables, the sequences' token lists, lengths) may go to the device with
`.to(device, non_blocking=True)`; those uploads are not counted. The step's work is what
`LLMEngine._step_speculative` does: with overlap, the read of the plain step left in flight
before it is that step's own read, outside. Constrained (grammar) rows and tensor
parallelism read their drafts on purpose (masks and the broadcast plan are host data) and
are not exercised here.

The engines: the tiny target with a head whose draft vocabulary is the target's commonest
answer tokens, so drafts get accepted (KV moves, several tokens a step); greedy and seeded
rows together, prompts long enough to prefill in chunks beside the verify rows.
"""

import dataclasses
from collections import Counter

import pytest
import torch

from wire import protocol as P
from speculative.head import save_head
from tests.replica.spec_engines import engine
from tests.replica.sync_count import SyncCounter
from tests.speculative.util import random_head, tiny_target

PROMPTS = {"a": [5, 9, 2, 7, 5, 9, 2], "b": list(range(3, 50)), "c": [11, 4, 11, 4, 11, 4]}
KINDS = {"eagle3-chain": {}, "eagle3-tree": {}, "eagle3-sampled": dict(spec_sample=True), "ngram": {}}


def sampling(k):
    if k == "a":
        return P.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return P.SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)


def run(eng):
    for k, ids in PROMPTS.items():
        assert eng.add(P.Generate(id=k, prompt_ids=ids, sampling=sampling(k))) is None
    toks = {}
    while eng.has_work():
        for m in eng.step():
            toks.setdefault(m.id, []).extend(m.ids)
    return toks


@pytest.fixture(scope="module")
def common_head(tmp_path_factory):
    """A head drafting only the plain answers' three commonest tokens: its drafts are often right."""
    common = Counter(t for ids in run(engine()).values() for t in ids).most_common(3)
    head = random_head(tiny_target(), draft_vocab=3)
    head.d2t.copy_(torch.tensor(sorted(t for t, _ in common)))
    return str(save_head(head, tmp_path_factory.mktemp("eagle3") / "common"))


def counted(eng) -> list[SyncCounter]:
    """Count each speculative step of `eng` apart (instrumentation around the real step). The
    engine's kernel set is exempt: on a GPU each op is one Triton launch; only its CPU
    references read the host (any other function of kernels/ the step calls is counted)."""
    steps, step = [], eng._step_speculative
    ops = [getattr(eng.runner.ops, f.name) for f in dataclasses.fields(eng.runner.ops)]

    def spec_step(batch):
        with SyncCounter(exempt=[f for f in ops if callable(f)]) as c:
            out = step(batch)
        steps.append(c)
        return out

    eng._step_speculative = spec_step
    return steps


def count_verify_buffers(eng) -> list:
    """The verify steps that ran through the verify graphs' buffers (replica.model.spec_graphs)."""
    runs, run_verify = [], eng.runner.verify_graphs.run

    def counted_run(plan, drafts):
        runs.append(len(plan.starts))
        return run_verify(plan, drafts)

    eng.runner.verify_graphs.run = counted_run
    return runs


@pytest.mark.parametrize("graphs", ["auto", "buffers"])
@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_speculative_step_reads_the_host_once(kind, overlap, graphs, common_head):
    """graph_mode "buffers": plain steps through the decode graphs' buffers and pure verify steps
    through the verify graphs' (the padded path a CUDA graph replays), on CPU."""
    spec = "eagle3-chain" if kind == "eagle3-sampled" else kind
    eng = engine(spec, common_head, overlap=overlap, graph_mode=graphs, **KINDS[kind])
    steps = counted(eng)
    verifies = count_verify_buffers(eng) if graphs == "buffers" and kind != "ngram" else None
    toks = run(eng)
    assert all(len(t) == 12 for t in toks.values())
    assert len(steps) >= 3 and (eng.stats.accepted > 0 or kind == "ngram")  # ngram: host drafts
    assert verifies is None or verifies, "some verify steps ran through the verify buffers"
    assert verifies is None or eng.speculator.drafter.graphs.outputs, "the draft loop ran through its buffers"
    worst = max(steps, key=lambda c: c.count)
    assert worst.count <= 1, f"{worst.count} host reads/syncs in one step: " + "; ".join(worst.reads + worst.syncs)
