"""The engine's one emit path (`LLMEngine._emit`): a stop reached inside a
speculating row's accepted run cuts the run exactly there and finishes the request
once, with the figures plain decoding gives for the same stop; and the per-row
Sampling settings travel to tensor-parallel ranks as compact msgpack arrays."""

import msgspec
import pytest
import torch

from wire import protocol as P
from replica.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from replica.model.graphs import resolve_placeholders
from replica.model.plan import Sampling, StepPlan, is_placeholder, placeholder, placeholder_index
from speculative.drafting import chain
from tests.replica.spec_engines import CFG, W
from tests.replica.tiny import tiny_config

PROMPTS = {"a": [11, 12, 13, 14, 15, 16, 17], "b": [30, 31, 32, 33, 34]}  # "a" stops, "b" runs on beside it
MAX_TOKENS = 30
K = 4  # drafts per speculating step: every such step emits K + 1 tokens (the drafts, then the bonus)
RUN = 6  # generated index of the second speculating step's first token (prefill gave index 0, step one 1..5)


class PerfectDrafter:
    """Drafts the reference continuation, so every draft is accepted: a speculating
    step emits exactly K + 1 tokens, and a stop lands where the test puts it."""

    def __init__(self, references: list[list[int]]):
        self.refs, self.k = references, K

    @property
    def lookahead(self) -> int:
        return self.k

    def propose(self, tokens):
        n = len(tokens)
        ref = next(r for r in self.refs if r[:n] == list(tokens))
        return chain(int(tokens[-1]), ref[n : n + self.k])


def build(speculative: bool, eos: tuple[int, ...] = (0,), overlap: bool = False, refs=None) -> LLMEngine:
    kw = dict(num_blocks=64, block_size=16, max_num_seqs=8, max_num_batched_tokens=40, overlap=overlap)
    if speculative:
        kw.update(speculative="ngram", spec_depth=K)
    eng = LLMEngine(EngineConfig(**kw), tiny_config(num_layers=4, eos_token_ids=eos), W)  # CFG's weights
    if speculative:
        eng.speculator._specs = [None] + [PerfectDrafter(refs)] * eng.cfg.max_num_seqs
    return eng


def run(eng: LLMEngine, params: dict) -> tuple[dict, dict]:
    """Step until idle; {id: [(message type, ids), ...] in order}, {id: [Finished, ...]}."""
    for k, ids in PROMPTS.items():
        assert eng.add(P.Generate(id=k, prompt_ids=ids, sampling=params[k])) is None
    msgs, fins = {}, {}
    while eng.has_work():
        for m in eng.step():
            msgs.setdefault(m.id, []).append((type(m).__name__, list(m.ids)))
            if isinstance(m, P.Finished):
                fins.setdefault(m.id, []).append(m)
    eng.blocks.check_invariants()
    assert eng.blocks.num_free == eng.blocks.num_blocks and not eng.seqs
    return msgs, fins


def greedy(max_tokens=MAX_TOKENS, **kw):
    return P.SamplingParams(max_tokens=max_tokens, temperature=0.0, **{"ignore_eos": True, **kw})


@pytest.fixture(scope="module")
def base() -> dict[str, list[int]]:
    """The plain engine's greedy tokens, no stop but max_tokens."""
    msgs, _ = run(build(False), {k: greedy() for k in PROMPTS})
    assert len(CFG.eos_token_ids) == 1  # the weights above are CFG's: only the EOS id differs
    return {k: [t for _, ids in m for t in ids] for k, m in msgs.items()}


def stop_at(base, kind: str, index: int):
    """(engine kwargs, {id: params}, finish reason) that stop "a" at its generated token `index`."""
    tok = base["a"][index]
    assert tok not in base["a"][:index], "pick a position whose token is new to the stream"
    if kind == "stop_token_ids":
        return {}, {"a": greedy(stop_token_ids=[tok]), "b": greedy()}, P.FINISH_STOP
    if kind == "eos":  # "b" ignores EOS: it runs on through the same token
        return {"eos": (tok,)}, {"a": greedy(ignore_eos=False), "b": greedy()}, P.FINISH_STOP
    return {}, {"a": greedy(max_tokens=index + 1), "b": greedy()}, P.FINISH_LENGTH


@pytest.mark.parametrize("offset", [0, 2, K])  # the step's first draft, a middle one, its bonus token
@pytest.mark.parametrize("kind", ["stop_token_ids", "eos", "max_tokens"])
def test_a_stop_inside_an_accepted_run_cuts_it_there_and_finishes_once(base, kind, offset):
    index = RUN + offset
    kw, params, reason = stop_at(base, kind, index)
    eng = build(True, refs=[PROMPTS[k] + base[k] for k in PROMPTS], **kw)
    msgs, fins = run(eng, params)

    a = msgs["a"]
    assert [len(ids) for _, ids in a] == [1, K + 1, offset + 1]  # prefill, a full run, the cut run
    assert [t for _, ids in a for t in ids] == base["a"][: index + 1]
    assert [t for t, _ in a] == ["Tokens", "Tokens", "Finished"] and len(fins["a"]) == 1
    fin = fins["a"][0]
    assert fin.finish_reason == reason and fin.ids == base["a"][RUN : index + 1]
    assert fin.usage.prompt_tokens == len(PROMPTS["a"]) and fin.usage.completion_tokens == index + 1
    assert fin.usage.accepted_draft_tokens == K + min(K, offset + 1)  # drafts emitted, the cut ones not counted

    assert [t for _, ids in msgs["b"] for t in ids] == base["b"]  # the row beside it is untouched
    assert len(fins["b"]) == 1 and fins["b"][0].finish_reason == P.FINISH_LENGTH


@pytest.mark.parametrize("kind", ["stop_token_ids", "eos", "max_tokens"])
def test_plain_and_speculative_paths_finish_alike(base, kind):
    """The same stop through the plain step (synchronous and overlapped) and the
    speculating step: the same tokens and the same Finished figures (accepted drafts
    aside, which only speculation has)."""
    kw, params, reason = stop_at(base, kind, RUN + 2)
    refs = [PROMPTS[k] + base[k] for k in PROMPTS]
    outs = {}
    for name, eng in {"plain": build(False, **kw), "plain-overlap": build(False, overlap=True, **kw),
                      "speculative": build(True, refs=refs, **kw),
                      "speculative-overlap": build(True, overlap=True, refs=refs, **kw)}.items():
        msgs, fins = run(eng, params)
        assert all(len(f) == 1 for f in fins.values()), name
        outs[name] = {k: ([t for _, ids in m for t in ids], fins[k][0]) for k, m in msgs.items()}

    plain = outs["plain"]
    assert plain["a"][1].finish_reason == reason and plain["a"][0] == base["a"][: RUN + 3]
    for name, out in outs.items():
        for k in PROMPTS:
            (toks, fin), (want_toks, want) = out[k], plain[k]
            assert toks == want_toks, (name, k)
            assert fin.finish_reason == want.finish_reason, (name, k)
            assert msgspec.structs.replace(fin.usage, accepted_draft_tokens=0) == want.usage, (name, k)
            assert want.usage.accepted_draft_tokens == 0
            assert (fin.usage.accepted_draft_tokens > 0) == name.startswith("speculative"), (name, k)


def test_sampling_rows_round_trip_through_msgpack_as_arrays():
    """A plan is broadcast to tensor-parallel ranks as msgpack (Runner.execute / loop):
    each Sampling row travels as a bare 5-element array, no field names."""
    rows = [Sampling(temperature=0.7, top_k=40, top_p=0.9, seed=2**63 - 1, position=123),
            Sampling(temperature=0.0, top_k=0, top_p=1.0, seed=0, position=7)]
    wire = msgspec.msgpack.encode(rows[0])
    assert msgspec.msgpack.decode(wire) == [0.7, 40, 0.9, 2**63 - 1, 123]
    assert msgspec.msgpack.decode(wire, type=Sampling) == rows[0]
    plan = StepPlan(input_ids=[5, placeholder(0)], starts=[3, 0], num_tokens=[1, 1], block_tables=[[0], [1]],
                    sample_rows=[0, 1], num_decodes=2, sampling=rows)
    got = msgspec.msgpack.Decoder(StepPlan).decode(msgspec.msgpack.Encoder().encode(plan))
    assert got == plan and all(type(s) is Sampling for s in got.sampling)
    assert got.sampling[0].seed == 2**63 - 1 and got.sampling[1].position == 7


def test_placeholders_name_the_in_flight_steps_tokens():
    assert [placeholder(j) for j in range(3)] == [-1, -2, -3]
    assert all(is_placeholder(placeholder(j)) and placeholder_index(placeholder(j)) == j for j in range(5))
    assert not is_placeholder(0)
    ids = torch.tensor([7, placeholder(1), 0, placeholder(0)])
    assert is_placeholder(ids).tolist() == [False, True, False, True]
    assert resolve_placeholders(ids, torch.tensor([40, 41])).tolist() == [7, 41, 0, 40]
