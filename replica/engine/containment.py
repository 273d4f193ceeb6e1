"""Crash containment: a request that makes a step fail fails alone.

`Containment(engine)` stands between the engine process's loop and the engine.
When `engine.step()` raises, every sequence that can have been in that step (the
running ones and those of a step still in flight) is a suspect:

  1. each suspect is reset to recompute: its blocks go back (full blocks stay in
     the prefix cache, so the recompute is mostly hits) and placeholder tokens that
     were never read back are dropped (they were never sent; sampling is a function
     of (seed, position), so they come out the same again);
  2. the suspects are searched, everything else held back: a group runs alone
     until each member has sampled two more tokens (one after a prefill, one
     decode) or finished. A group that passes is clean; a failing group is split
     in halves and each half searched; a single sequence that fails alone is the
     culprit and gets `Error(engine_fault)`, which the proxy never retries.
     Tokens produced while searching are real and are sent as usual;
  3. everyone else resumes where they were, at the front of the queue.

A failure no request explains (nobody fails alone) is taken for a transient;
`max_unexplained` of them in a row, or a group of two or more whose every member
fails alone, mean the engine itself is broken (say, a sticky device error):
`EngineBroken` is raised, the process exits and its API process restarts it.
With tensor parallelism the ranks would wait for each other in a collective, so
the exception is re-raised at once (the same restart).

While searching, the engine reads no new messages: a few extra steps once per
failure. A failure while adding a request fails that request.
"""

from __future__ import annotations

import logging
from wire import protocol as P
from replica.engine.sequence import Sequence, Status

log = logging.getLogger("replica.engine.containment")

PROBE_TOKENS = 2  # tokens a suspect must sample alone to be cleared
MAX_PROBE_STEPS = 10_000  # a probe that makes no headway this long passes (never seen: prefill always advances)


class EngineBroken(RuntimeError):
    """Step failures that no single request explains: restart the engine process."""


def fault_error(seq_id: str, err: BaseException) -> P.Error:
    return P.Error(code=P.ENGINE_FAULT, id=seq_id,
                   message=f"this request made the engine fail ({type(err).__name__}: {str(err)[:200]}); "
                           "it failed alone and must not be retried elsewhere")


class Containment:
    def __init__(self, engine, max_unexplained: int = 3):
        self.engine = engine
        self.max_unexplained = max_unexplained
        self.unexplained = 0  # failures in a row that no request explained
        self.num_faults = 0  # requests failed as culprits

    def add(self, req: P.Generate) -> P.Error | None:
        """engine.add; an exception fails this request only."""
        eng = self.engine
        known = req.id in eng.seqs
        try:
            return eng.add(req)
        except Exception as e:  # noqa: BLE001 - any failure of one request is that request's
            log.exception("engine: adding request %r failed", req.id)
            seq = eng.seqs.pop(req.id, None) if not known else None
            if seq is not None:  # half added: out of every queue, blocks back
                eng.forks.discard(seq)
                self._reset(seq)
                seq.status = Status.FINISHED
            self.num_faults += 1
            return fault_error(req.id, e)

    def step(self) -> list:
        """engine.step(); on an exception, find and fail the request(s) that caused it."""
        try:
            return self.engine.step()
        except Exception as e:  # noqa: BLE001 - contained below, or EngineBroken
            if self.engine.runner.tp.world > 1:
                raise
            log.exception("engine: step failed; searching the batch for the request that caused it")
            return self._contain(e)

    # -- search -----------------------------------------------------------------------
    def _contain(self, first: Exception) -> list:
        eng = self.engine
        sch = eng.scheduler
        suspects = list(sch.running)
        suspects += [s for s in eng.drop_inflight() if s.status != Status.FINISHED and s not in suspects]
        if not suspects:
            raise EngineBroken(f"a step failed with no request in it: {first!r}") from first
        for s in suspects:
            self._reset(s)
        # Everyone else waits in the saved queues (holding no blocks) while suspects run alone.
        saved = sch.running, sch.waiting
        sch.running, sch.waiting = [], {}
        overlap, eng.overlap = eng.overlap, False  # probes read every step back: nothing left in flight
        out: list = []
        culprits: list[tuple[Sequence, Exception]] = []
        self._released: list[Sequence] = []  # samples released to the queue by a probe (their leader's prefill)
        try:
            self._search(suspects, out, culprits)
        finally:
            eng.overlap = overlap
            sch.running, sch.waiting = saved
        guilty = {s for s, _ in culprits}
        for s in reversed(suspects + self._released):  # the cleared ones resume first, in their old order
            if s not in guilty and s.status != Status.FINISHED:
                sch.add(s, front=True)
        for s, err in culprits:
            sch.add(s)
            eng.abort(s.id)  # out of the engine; samples waiting for it (n > 1) are released
            out.append(fault_error(s.id, err))
        self.num_faults += len(culprits)
        if len(suspects) > 1 and len(culprits) == len(suspects):
            raise EngineBroken(f"all {len(suspects)} requests of a failing step fail alone: the engine, not a "
                               f"request, is broken ({first!r})") from first
        self.unexplained = 0 if culprits else self.unexplained + 1
        if self.unexplained >= self.max_unexplained:
            raise EngineBroken(f"{self.unexplained} step failures in a row that no request explains "
                               f"(last: {first!r})") from first
        log.warning("engine: %d of %d suspects failed alone (%s); the others continue", len(culprits),
                    len(suspects), ", ".join(s.id for s in guilty) or "none: a transient")
        return out

    def _search(self, group: list[Sequence], out: list, culprits: list) -> None:
        err = self._probe(group, out)
        if err is None:
            return
        if len(group) == 1:
            culprits.append((group[0], err))
            return
        half = len(group) // 2
        self._search(group[:half], out, culprits)
        self._search(group[half:], out, culprits)

    def _probe(self, group: list[Sequence], out: list) -> Exception | None:
        """Run `group` alone (queues otherwise empty); the exception that stopped it, if any."""
        eng, sch = self.engine, self.engine.scheduler
        live = [s for s in group if s.status != Status.FINISHED]
        goal = {s: len(s.token_ids) + PROBE_TOKENS for s in live}
        for s in live:
            sch.add(s)
        err = None
        try:
            for _ in range(MAX_PROBE_STEPS):
                if all(s.status == Status.FINISHED or len(s.token_ids) >= goal[s] for s in live):
                    break
                out.extend(eng.step())
        except Exception as e:  # noqa: BLE001 - the probe's verdict
            err = e
        for s in live:
            if s.status != Status.FINISHED:
                self._reset(s)
        for s in sch.running + [s for q in sch.waiting.values() for s in q]:  # released by a leader's prefill
            self._reset(s)
            self._released.append(s)
        return err

    def _reset(self, seq: Sequence) -> None:
        """Out of the queues, blocks given back, unread placeholders dropped: it recomputes on return."""
        sch = self.engine.scheduler
        if seq in sch.running:
            sch.running.remove(seq)
        else:
            q = sch.waiting.get(seq.priority)
            if q is not None and seq in q:
                q.remove(seq)
        self.engine.blocks.free(seq)
        if seq.num_unresolved:
            del seq.token_ids[-seq.num_unresolved:]
            seq.num_unresolved = 0
        seq.draft_state = None
        seq.status = Status.WAITING
