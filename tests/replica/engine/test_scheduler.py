"""The scheduler on its own (replica/engine/scheduler.py's invariants): a real BlockManager and
real Sequences, no engine and no model. Each step is advanced as the engine's
synchronous path advances it (LLMEngine._launch, then _resolve): every scheduled
sequence computes its tokens, one whose chunk reaches its last token samples one
more, a stop finishes it (its blocks committed, then given back), the others' full
blocks are committed. After every step the block pool's accounting holds and every
block is held by exactly the running sequences' tables."""

from __future__ import annotations

import random
from collections import Counter

from wire import protocol as P
from replica.engine.block_manager import BlockManager
from replica.engine.scheduler import Batch, Scheduler
from replica.engine.sequence import Sequence, Status

BLOCK = 4  # tokens per block: small, so a few tokens cross block boundaries


class Sim:
    """A Scheduler over a BlockManager, stepped without a model. `generated[id]` holds the
    tokens a sequence sampled, `finished[id]` its finish reason, `batches` every step's
    (ids, tokens) in batch order."""

    def __init__(self, num_blocks: int = 64, max_num_seqs: int = 8, max_num_batched_tokens: int = 16,
                 prefill_only_tokens: int = 0):
        self.blocks = BlockManager(num_blocks, BLOCK)
        self.sched = Scheduler(self.blocks, max_num_seqs, max_num_batched_tokens,
                               prefill_only_tokens=prefill_only_tokens)
        self.seqs: dict[str, Sequence] = {}
        self.generated: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.batches: list[tuple[list[str], list[int]]] = []

    def add(self, rid: str, prompt: list[int], max_tokens: int = 4, priority: int = P.INTERACTIVE,
            cache_salt: str = "", resume: list[int] = ()) -> Sequence:
        seq = Sequence(rid, prompt, P.SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=0,
                       eos_ids=frozenset(), priority=priority, cache_salt=cache_salt, resume_ids=resume)
        seq.arrival = len(self.seqs)  # arrival order made explicit (time.monotonic() may tie)
        self.seqs[rid] = seq
        self.generated[rid] = []
        self.sched.add(seq)
        return seq

    def budget(self) -> int:
        """The step's token budget (the module docstring): max_num_batched_tokens while
        sequences decode, at least half of it left for prefill; prefill_only_tokens when none does."""
        s = self.sched
        decoding = sum(1 for q in s.running if q.is_decode)
        return max(s.max_num_batched_tokens, decoding + s.max_num_batched_tokens // 2) if decoding \
            else s.prefill_only_tokens

    def step(self) -> Batch:
        s = self.sched
        budget, decoding = self.budget(), {q for q in s.running if q.is_decode}
        batch = s.schedule()
        rows = list(zip(batch.seqs, batch.num_tokens))
        # what every schedule() promises
        assert len(set(batch.seqs)) == len(batch.seqs) and set(batch.seqs) <= set(s.running)
        assert len(s.running) <= s.max_num_seqs and sum(batch.num_tokens) <= budget
        assert all(0 < n <= q.num_uncomputed and self.blocks.blocks_needed(q, n) == 0 for q, n in rows)
        d = batch.num_decodes
        assert all(n == 1 and q.is_decode for q, n in rows[:d]), "decodes lead the batch"
        assert not any(n == 1 and q.is_decode for q, n in rows[d:])
        assert decoding - set(batch.seqs) <= {q for q in decoding if q.status == Status.WAITING}, \
            "a decode that kept its seat computes its token"
        self.batches.append(([q.id for q in batch.seqs], list(batch.num_tokens)))
        # LLMEngine._launch: the tokens are computed; a row reaching its last token samples one
        for q, n in rows:
            q.num_computed += n
        for q, _ in rows:
            if q.num_computed == len(q):
                tok = 1 + (31 * len(q) + sum(map(ord, q.id))) % 96
                q.token_ids.append(tok)
                self.generated[q.id].append(tok)
                # LLMEngine._resolve / _finish: a stop commits its blocks and gives them back
                reason = q.check_stop(tok, len(q), s.max_model_len)
                if reason:
                    self.blocks.commit(q)
                    s.remove(q)
                    self.finished[q.id] = reason
        for q, _ in rows:
            if q.status != Status.FINISHED:
                self.blocks.commit(q)
        self.check()
        return batch

    def abort(self, rid: str) -> None:
        """LLMEngine.abort: out of the queues, its blocks given back."""
        self.sched.remove(self.seqs[rid])
        self.check()

    def check(self) -> None:
        self.blocks.check_invariants()
        held = Counter(b for q in self.sched.running for b in q.block_table)
        assert all(self.blocks.ref_count[b] == held[b] for b in range(self.blocks.num_blocks)), \
            "a block is referenced by something other than a running sequence's table"
        for q in (q for queue in self.sched.waiting.values() for q in queue):
            assert q.status == Status.WAITING and not q.block_table and q.num_computed == 0

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                break
            self.step()
        assert not self.sched.has_work(), f"still busy after {max_steps} steps"
        assert self.blocks.num_free == self.blocks.num_blocks and not any(self.blocks.ref_count)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 97) for _ in range(n)]


def test_running_decodes_come_before_every_prefill_chunk():
    """Invariant 1: running decodes are scheduled first, one token each, ahead of running
    prefill chunks and of admissions, whatever their class; among decodes, class then arrival."""
    sim = Sim(max_num_batched_tokens=16)
    sim.add("b", ids(3, 1), max_tokens=30, priority=P.BATCH)
    sim.step()
    sim.add("i", ids(40, 2), max_tokens=2)  # interactive, and a prompt in chunks
    sim.step()
    sim.add("w", ids(5, 3), max_tokens=2)
    for _ in range(3):
        sim.step()
    assert sim.batches == [
        (["b"], [3]),
        (["b", "i"], [1, 15]),  # the batch-class decode ahead of the interactive prompt
        (["b", "i"], [1, 15]),  # w waits: the budget is spent
        (["b", "i", "w"], [1, 10, 5]),  # running chunk, then the admission
        (["i", "w", "b"], [1, 1, 1]),  # three decodes: interactive ones first, by arrival
    ]
    sim.run()
    assert sim.finished == {"i": "length", "w": "length", "b": "length"}


def test_long_prompt_is_chunked_and_running_decodes_never_stall():
    """Invariants 1 and 2: a prompt longer than the budget is computed in chunks beside the
    running decodes, each of which still gains one token every step; prefill keeps half the
    budget however many decode, and takes prefill_only_tokens when none does."""
    sim = Sim(max_num_batched_tokens=8, prefill_only_tokens=32)
    for k in range(6):
        sim.add(f"d{k}", ids(2, 10 + k), max_tokens=40)
    sim.step()  # nothing decodes yet: budget 32, all six prompts at once
    sim.add("long", ids(50, 20), max_tokens=2)
    chunks = []
    while not sim.generated["long"]:
        before = {k: len(sim.generated[f"d{k}"]) for k in range(6)}
        batch = sim.step()
        rows = dict(zip((q.id for q in batch.seqs), batch.num_tokens))
        assert all(len(sim.generated[f"d{k}"]) == before[k] + 1 for k in range(6)), "a decode stalled"
        assert batch.num_decodes == 6  # and the prompt's chunk: what is left of max(8, 6 + 8 // 2)
        chunks.append(rows["long"])
    assert chunks == [4] * 12 + [2]  # 50 prompt tokens, 4 a step beside six decodes
    sim.run()
    sim.add("alone", ids(50, 21), max_tokens=1)
    sim.run()
    assert sim.batches[-2:] == [(["alone"], [32]), (["alone"], [18])]  # no decode waits: bigger chunks


def test_max_num_seqs_caps_the_running_set():
    """max_num_seqs: never more running sequences (nor batch rows) than seats; waiting
    requests are admitted in arrival order as seats free up."""
    sim = Sim(max_num_seqs=3, max_num_batched_tokens=64)
    for k in range(6):
        sim.add(f"s{k}", ids(4, 30 + k), max_tokens=2 + k)
    first: dict[str, int] = {}
    step = 0
    while sim.sched.has_work():
        step += 1
        batch = sim.step()
        assert len(batch.seqs) <= 3 and len(sim.sched.running) <= 3
        for q in batch.seqs:
            first.setdefault(q.id, step)
        if step == 1:
            assert sim.sched.num_waiting == 3
    # s0 finishes in step 2 (two tokens), its seat goes to s3 in step 3; s1 in 3 -> s4 in 4; ...
    assert first == {"s0": 1, "s1": 1, "s2": 1, "s3": 3, "s4": 4, "s5": 5}
    assert {k: len(v) for k, v in sim.generated.items()} == {f"s{k}": 2 + k for k in range(6)}
    sim.run()


def test_priority_classes_order_admission():
    """Invariant 3: waiting requests are admitted by priority class (interactive before
    batch), then by arrival within a class."""
    sim = Sim(max_num_seqs=1, max_num_batched_tokens=64)
    for k, (rid, prio) in enumerate((("b0", P.BATCH), ("b1", P.BATCH), ("i0", P.INTERACTIVE), ("i1", P.INTERACTIVE))):
        sim.add(rid, ids(5, 80 + k), max_tokens=2, priority=prio)
    sim.run()
    admitted = list(dict.fromkeys(rid for rows, _ in sim.batches for rid in rows))
    assert admitted == ["i0", "i1", "b0", "b1"]


def test_interactive_work_takes_blocks_from_batch_work_never_the_reverse():
    """Preemption respects the classes: a waiting interactive request preempts running
    batch work when blocks run out; a waiting batch request never preempts interactive
    work: it waits until blocks come back."""
    sim = Sim(num_blocks=4, max_num_batched_tokens=32)
    b = sim.add("b", ids(12, 40), max_tokens=4, priority=P.BATCH)  # 16 tokens: the whole pool at the end
    sim.step()  # b: three blocks
    i = sim.add("i", ids(8, 41), max_tokens=2)
    batch = sim.step()  # b's decode takes the last block; i needs two
    assert batch.seqs == [i] and sim.sched.num_preemptions == 1
    assert b.status == Status.WAITING and not b.block_table and sim.sched.waiting[P.BATCH][0] is b
    sim.run()
    assert sim.finished == {"i": "length", "b": "length"} and len(sim.generated["b"]) == 4

    sim = Sim(num_blocks=4, max_num_batched_tokens=32)
    i = sim.add("i", ids(12, 42), max_tokens=3)
    sim.step()
    b = sim.add("b", ids(8, 43), max_tokens=2, priority=P.BATCH)
    while "i" not in sim.finished:
        sim.step()
        assert i.status != Status.WAITING and b.status == Status.WAITING  # b waits, i keeps its blocks
    sim.run()
    assert sim.sched.num_preemptions == 0 and sim.finished == {"i": "length", "b": "length"}


def test_preemption_by_recompute_when_blocks_run_out():
    """When the pool runs dry the running sequence of the lowest priority that arrived
    last is preempted: back to the front of its waiting queue with its blocks freed and
    its tokens kept; its full blocks stay cached, so its recompute starts from prefix hits."""
    sim = Sim(num_blocks=6, max_num_seqs=2, max_num_batched_tokens=32)
    a = sim.add("a", ids(8, 50), max_tokens=12)
    b = sim.add("b", ids(8, 51), max_tokens=12)
    c = sim.add("c", ids(4, 52), max_tokens=2)  # waits for a seat
    while not sim.sched.num_preemptions:
        tokens_b = list(b.token_ids)
        batch = sim.step()
    assert sim.sched.num_preemptions == 1 and a in batch.seqs and b not in batch.seqs  # b arrived last
    assert b.status == Status.WAITING and list(sim.sched.waiting[P.INTERACTIVE]) == [b, c]  # ahead of c
    assert b.block_table == [] and b.num_computed == 0 and b.token_ids == tokens_b  # recompute, not restart
    assert sim.blocks.num_free == 6 - len(a.block_table)
    while b.status == Status.WAITING:
        batch = sim.step()
    recompute = dict(zip((q.id for q in batch.seqs), batch.num_tokens))["b"]
    hit = len(tokens_b) - recompute  # admitted again: its own full blocks, still cached, matched
    assert hit > 0 and hit % BLOCK == 0
    assert all("c" not in rows for rows, _ in sim.batches[:-1])  # c's first seat comes after b's return
    sim.run()
    assert sim.finished == {"a": "length", "b": "length", "c": "length"}
    assert len(sim.generated["a"]) == 12 and len(sim.generated["b"]) == 12


def test_prefix_cache_hit_reduces_the_tokens_to_prefill():
    """Admission reuses cached prefix blocks: a prompt sharing full blocks with a finished
    one prefills only the rest (a fully cached prompt still computes its last block's
    tokens, for the logits; one cached but for its last token is a decode row, ahead of
    the prefill chunks); another cache salt, or another prefix, hits nothing."""
    sim = Sim(max_num_batched_tokens=64)
    system = ids(20, 60)
    a = sim.add("a", system, max_tokens=2)
    sim.step()
    cached = list(a.block_table[:4])
    sim.run()
    sim.add("b", system[:16] + ids(6, 61))  # four full blocks shared, then its own
    sim.add("c", system)  # the same prompt: (20 - 1) // 4 blocks reusable
    sim.add("d", ids(22, 62))
    sim.add("e", system, cache_salt="another tenant")
    sim.add("f", system[:17])  # four blocks cached, one token to compute
    batch = sim.step()
    seqs = sim.seqs
    assert dict(zip(*sim.batches[-1])) == {"b": 22 - 16, "c": 20 - 16, "d": 22, "e": 20, "f": 1}
    assert {k: seqs[k].num_cached_prompt for k in "bcdef"} == {"b": 16, "c": 16, "d": 0, "e": 0, "f": 16}
    assert batch.seqs[0] is seqs["f"] and batch.num_decodes == 1
    assert seqs["b"].block_table[:4] == seqs["c"].block_table[:4] == seqs["f"].block_table[:4] == cached
    assert all(sim.blocks.ref_count[blk] == 3 for blk in cached)
    sim.run()


def test_a_moved_stream_whose_kv_is_cached_goes_before_a_prompts_chunk_one_to_recompute_does_not():
    """A resume (a drained replica's stream handed on with its KV) whose blocks are cached but the
    last partial one is admitted ahead of the running prompt's chunk and of the prompts queued
    before it: one short prefill and it streams again. One with its KV not here waits its turn."""
    sim = Sim(max_num_batched_tokens=16)
    moved = ids(20, 70)
    sim.add("a", moved, max_tokens=2)
    sim.run()  # its 5 full blocks are cached (as a pull leaves them)
    sim.add("p", ids(40, 71), max_tokens=2)  # a long prompt, in chunks
    sim.step()
    sim.add("q", ids(6, 72), max_tokens=2)  # a prompt queued before the moved streams
    sim.add("x", ids(20, 73), resume=[5, 6])  # moved with nothing cached: 22 tokens to recompute
    r = sim.add("r", moved[:18], max_tokens=8, resume=moved[18:] + sim.generated["a"])  # 22 tokens, 20 cached
    sim.step()
    assert sim.batches[-1] == (["r", "p"], [2, 14])  # r first (its last 2 tokens), then p's chunk
    assert r.num_cached_prompt == 20 and sim.seqs["x"].status == Status.WAITING
    sim.step()
    assert sim.batches[-1][0][:1] == ["r"]  # decoding now, ahead of every prefill
    sim.run()
    assert set(sim.finished) == {"a", "p", "q", "x", "r"}


def test_moved_streams_go_ahead_under_a_budget_below_two_blocks():
    """The CPU's budget (32 tokens, two blocks) less the running decodes is below two blocks: the
    moved streams whose last block or two are left still go before the prompt queued ahead of them,
    each whole while it fits, the rest of the budget to the prompt (they once waited behind it)."""
    sim = Sim(max_num_batched_tokens=8)  # two blocks of 4
    moved = ids(10, 80)
    sim.add("a", moved, max_tokens=2)
    sim.run()  # its 2 full blocks are cached
    sim.add("d1", ids(3, 81), max_tokens=12)
    sim.add("d2", ids(3, 82), max_tokens=12)
    sim.step()
    sim.step()  # d1, d2 decode: 6 of the 8 tokens left
    sim.add("q", ids(9, 83), max_tokens=2)  # a prompt queued before the moved streams
    r = sim.add("r", moved[:8], max_tokens=4, resume=moved[8:] + sim.generated["a"])  # 12 tokens, 8 cached
    s = sim.add("s", moved[:8], max_tokens=4, resume=moved[8:] + sim.generated["a"])
    sim.step()
    assert sim.batches[-1] == (["d1", "d2", "r", "q"], [1, 1, 4, 2])  # s (4 more) does not fit whole
    assert r.num_cached_prompt == 8 and s.status == Status.WAITING and not s.block_table
    sim.run()
    assert set(sim.finished) == {"a", "d1", "d2", "q", "r", "s"}


def test_an_abort_at_any_point_frees_its_blocks():
    """An abort (Scheduler.remove) at any step, of a sequence waiting, prefilling, decoding
    or preempted, gives back every block it held; the others finish as they would, and
    the pool ends whole."""

    def fresh() -> Sim:
        sim = Sim(num_blocks=10, max_num_seqs=3, max_num_batched_tokens=8)
        system = ids(20, 70)
        sim.add("p", system, max_tokens=6)
        sim.add("q", system[:16] + ids(3, 71), max_tokens=6)
        sim.add("long", ids(30, 72), max_tokens=4, priority=P.BATCH)
        sim.add("r", ids(6, 73), max_tokens=8)
        return sim

    ref = fresh()
    ref.run()
    steps = len(ref.batches)
    assert ref.sched.num_preemptions > 0  # the pool is tight enough to preempt
    states = set()
    for victim in ref.seqs:
        for at in range(steps + 1):
            sim = fresh()
            for _ in range(at):
                if sim.sched.has_work():
                    sim.step()
            seq = sim.seqs[victim]
            if seq.status == Status.FINISHED:
                continue
            states.add("waiting" if seq.status == Status.WAITING and not sim.generated[victim]
                       and all(victim not in rows for rows, _ in sim.batches)
                       else "preempted" if seq.status == Status.WAITING
                       else "decoding" if seq.is_decode else "prefilling")
            sim.abort(victim)
            assert seq.status == Status.FINISHED and not seq.block_table
            done = len(sim.batches)
            sim.run()
            assert all(victim not in rows for rows, _ in sim.batches[done:])
            assert {k: len(v) for k, v in sim.generated.items() if k != victim} == \
                {k: len(v) for k, v in ref.generated.items() if k != victim}
    assert states == {"waiting", "prefilling", "decoding", "preempted"}
