"""Session table: which API key owns a session id, and where it last ran.

A session id is bound to the key that first used it: another key gets
`forbidden` here, and its placement key (`placement_key`) differs anyway, so even
a proxy worker that has never seen the session routes the two apart. Bounded
LRU with an idle TTL; a forgotten session simply starts over at its rendezvous
replica.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Session:
    owner: str  # ApiKey.key_id
    replica: str | None = None
    last_used: float = 0.0


def placement_key(owner: str, session: str) -> str:
    return f"{owner}/{session}"


class SessionTable:
    def __init__(self, capacity: int = 100_000, ttl_s: float = 3600.0):
        self.capacity, self.ttl_s = capacity, ttl_s
        self._d: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def get(self, session: str, owner: str, now: float) -> Session | None:
        """The session (created for `owner` if new); None when another key owns it."""
        s = self._d.get(session)
        if s is not None and now - s.last_used > self.ttl_s:
            del self._d[session]
            s = None
        if s is None:
            s = self._d[session] = Session(owner, None, now)
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)
        elif s.owner != owner:
            return None
        self._d.move_to_end(session)
        s.last_used = now
        return s
