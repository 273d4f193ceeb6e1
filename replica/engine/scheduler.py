"""Continuous batching under a per-step token budget.

Each step (budget: max_num_batched_tokens while sequences decode, stretched so that
prefill keeps half of it beside many decodes; the larger prefill_only_tokens while
none decodes, when no stream's next token waits on the step):
  1. running decodes first (one token each), so streams never stall behind a prompt;
  2. running prefills continue in chunks with what is left of the budget, but first the waiting
     streams moved here (resumed, or preempted) whose KV is cached but the last block or two are
     admitted: one short prefill and they stream again, never queued behind a prompt;
  3. waiting requests are admitted (priority class, then arrival), reusing cached
     prefix blocks, their prompts chunked to fit the budget.
When the pool runs dry the scheduler preempts by recompute: the running sequence
of the lowest priority that arrived last gives back its blocks and goes back to
the front of its waiting queue (its full blocks stay cached, so the recompute is
mostly prefix hits).

Speculation (`speculation`, a replica.engine.speculation.Speculator): the step's draft
shape follows the number of decoding sequences. A speculating decode costs
1 + draft tokens of the budget (its tree is verified in the one forward) and
holds blocks for its lookahead, positions [0, len + lookahead); a decode whose
lookahead does not fit (blocks, budget or the context length) decodes plainly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from replica.engine.block_manager import BlockManager
from replica.engine.sequence import Sequence, Status


@dataclass
class Batch:
    """One step's work: seqs[i] computes num_tokens[i] tokens. Decodes come first."""

    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    num_decodes: int = 0
    spec: object = None  # the draft shape of rows [0, num_spec) (TreeSpec | NgramDrafter); None: no speculation
    num_spec: int = 0  # speculating decodes, first among the decodes


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int = 1 << 62, speculation=None, prefill_only_tokens: int = 0):
        self.blocks = blocks
        self.speculation = speculation
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # the budget of a step without decodes: no stream waits on it, so prompts go in bigger chunks
        self.prefill_only_tokens = max(prefill_only_tokens, max_num_batched_tokens)
        self.waiting: dict[int, deque[Sequence]] = {}  # priority class -> FIFO
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # -- queues -----------------------------------------------------------------
    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queue a sequence; `front`: ahead of its class (samples released after their leader's prefill)."""
        q = self.waiting.setdefault(seq.priority, deque())
        q.appendleft(seq) if front else q.append(seq)

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def waiting_tokens(self) -> int:
        return sum(s.num_uncomputed for q in self.waiting.values() for s in q)

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def _waiting_in_order(self):
        for prio in sorted(self.waiting):
            q = self.waiting[prio]
            while q:
                yield q

    def remove(self, seq: Sequence) -> None:
        """Take seq out of the queues and give back its blocks (finish or abort)."""
        if seq.status == Status.RUNNING:
            self.running.remove(seq)
        elif seq.status == Status.WAITING:
            self.waiting[seq.priority].remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED

    def _ends_by_length(self, seq: Sequence) -> bool:
        n = len(seq)
        return n - seq.num_prompt_tokens >= seq.sampling.max_tokens or n >= self.max_model_len

    # -- preemption ---------------------------------------------------------------
    def _victim(self) -> Sequence:
        return max(self.running, key=lambda s: (s.priority, s.arrival))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.WAITING
        self.num_preemptions += 1
        self.waiting.setdefault(seq.priority, deque()).appendleft(seq)

    # -- the step -------------------------------------------------------------------
    def speculates_next(self) -> bool:
        """Whether the next schedule() would draft (the batch size's policy says so)."""
        return self.speculation is not None and \
            self.speculation.spec_for(sum(1 for s in self.running if s.is_decode)) is not None

    def schedule(self) -> Batch:
        decoding = sum(1 for s in self.running if s.is_decode)
        # prefill keeps at least half the budget however many streams decode (a waiting prompt never starves)
        budget = max(self.max_num_batched_tokens, decoding + self.max_num_batched_tokens // 2) if decoding \
            else self.prefill_only_tokens
        scheduled: dict[Sequence, int] = {}  # seq -> tokens this step, in order
        speculating: set[Sequence] = set()
        spec, extra = None, 0  # draft shape, and the budget a speculating decode takes beyond its one token
        if self.speculation is not None:
            spec = self.speculation.spec_for(sum(1 for s in self.running if s.is_decode))
            extra = self.speculation.draft_tokens(spec) if spec is not None else 0

        def unschedule(victim: Sequence) -> int:
            tokens = scheduled.pop(victim, 0)
            if victim in speculating:
                speculating.discard(victim)
                tokens += extra
            return tokens

        def admit(q: deque, seq: Sequence) -> bool:
            """Admit waiting `seq` (in `q`) with what is left of the budget; False when it does not fit."""
            nonlocal budget
            if seq.num_computed == 0 and not seq.block_table:
                self.blocks.match_prefix(seq)
            if seq.num_cached_prompt < 0:  # a resume's input is its prompt and the tokens resumed
                seq.num_cached_prompt = min(seq.num_computed, len(seq.token_ids))
            n = min(seq.num_uncomputed, budget)
            while not self.blocks.allocate(seq, n):
                # Interactive work may take blocks from running batch work, never the reverse.
                victim = self._victim() if self.running else None
                if victim is None or victim.priority <= seq.priority:
                    break
                self._preempt(victim)
                budget += unschedule(victim)
            if self.blocks.blocks_needed(seq, n):
                self.blocks.free(seq)  # give back the prefix blocks until it fits
                return False
            q.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled[seq] = n
            budget -= n
            return True

        def admit_moved() -> None:
            """Admit, ahead of every prompt's chunk, the waiting streams moved here (a resume: tokens
            generated elsewhere, a drain's hand-off: edge_proxy.handoff) or preempted whose KV is
            cached but the last block or two: one short prefill each and they stream again, instead
            of waiting behind the prompts queued before them."""
            short = 2 * self.blocks.block_size
            for prio in sorted(self.waiting):
                q = self.waiting[prio]
                for seq in [w for w in q if w.num_completion_tokens and not w.num_unresolved]:
                    if budget <= 0 or len(self.running) >= self.max_num_seqs:
                        return
                    if seq.num_computed == 0 and not seq.block_table:
                        self.blocks.match_prefix(seq)
                    if seq.num_uncomputed > short:
                        self.blocks.free(seq)  # much to recompute: it waits its turn, as a prompt does
                    elif seq.num_uncomputed > budget:  # whole or not ahead (a budget below two blocks: the CPU's 32)
                        self.blocks.free(seq)
                        return
                    elif not admit(q, seq):
                        return

        # 1 + 2: running decodes, then running prefill chunks; each class by importance.
        # Decodes always fit: budget >= max_num_seqs >= len(running).
        moved_admitted = False
        for seq in sorted(self.running, key=lambda s: (not s.is_decode, s.priority, s.arrival)):
            if not moved_admitted and not seq.is_decode:
                moved_admitted = True
                admit_moved()
            if seq.status != Status.RUNNING:
                continue  # preempted earlier in this loop
            if seq.num_unresolved and self._ends_by_length(seq):
                continue  # overlap: its in-flight token is its last; nothing more to compute
            n = 1 if seq.is_decode else min(seq.num_uncomputed, budget)
            if n <= 0:
                continue
            if (spec is not None and seq.is_decode and seq.plain and budget >= 1 + extra
                    and len(seq) + spec.lookahead <= self.max_model_len
                    and self.blocks.allocate(seq, 1 + spec.lookahead)):
                speculating.add(seq)
                scheduled[seq] = 1
                budget -= 1 + extra
                continue
            while not self.blocks.allocate(seq, n):
                victim = self._victim()
                self._preempt(victim)
                budget += unschedule(victim)
                if victim is seq:
                    break
            if seq.status == Status.RUNNING:
                scheduled[seq] = n
                budget -= n

        if not moved_admitted:
            admit_moved()

        # 3: admit waiting sequences while budget, seats and blocks last.
        for q in self._waiting_in_order():
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            seq = q[0]
            if seq.num_unresolved:
                break  # preempted with a token still in flight: admit once it is read back
            if not admit(q, seq):
                break

        # Decodes first (speculating ones leading): the runner sends them to the decode
        # kernel (or the tree-verify forward), the rest to extend.
        order = sorted(scheduled, key=lambda s: 0 if s in speculating else 1 if scheduled[s] == 1 and s.is_decode
                       else 2)
        batch = Batch(seqs=order, num_tokens=[scheduled[s] for s in order])
        batch.num_decodes = sum(1 for s in order if scheduled[s] == 1 and s.is_decode)
        if speculating:
            batch.spec, batch.num_spec = spec, len(speculating)
        return batch
