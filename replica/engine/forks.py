"""Parallel samples (n > 1) share one prefill.

The API process sends the n samples of a request as n engine requests; samples
1..n-1 name sample 0 (their leader) in `Generate.fork_of`. A sample whose leader
is still waiting or prefilling is parked here instead of queued, and released to
the front of the waiting queue once the leader's prompt is computed (its blocks
committed to the prefix cache: the step that samples its first token) or once the
leader is gone. Admitted then, it finds the leader's full blocks by their chained
hashes and takes references to them (`BlockManager.match_prefix`): the prompt is
computed once, only the tokens after the last full block are computed again per
sample (fewer than a block), and each sample then decodes in blocks of its own.
"""

from __future__ import annotations

from replica.engine.sequence import Sequence


class Forks:
    def __init__(self):
        self._parked: dict[str, list[Sequence]] = {}  # leader id -> samples waiting for its prefill

    def __len__(self) -> int:
        return sum(len(v) for v in self._parked.values())

    def park(self, leader_id: str, seq: Sequence) -> None:
        self._parked.setdefault(leader_id, []).append(seq)

    def release(self, leader_id: str) -> list[Sequence]:
        """The samples waiting for this leader (its prompt is cached now, or it is gone)."""
        return self._parked.pop(leader_id, []) if self._parked else []

    def discard(self, seq: Sequence) -> bool:
        """Forget a parked sample (aborted before it started); False if it was not parked."""
        for leader, seqs in self._parked.items():
            if seq in seqs:
                seqs.remove(seq)
                if not seqs:
                    del self._parked[leader]
                return True
        return False
