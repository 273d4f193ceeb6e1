"""Session table: which API key owns a session id, and where it last ran.

A session id is bound to the key that first used it: another key gets
`forbidden` here, and its placement key (`placement_key`) differs anyway, so even
a proxy worker that has never seen the session routes the two apart.

A binding lasts until it has been idle for `ttl_s`; nothing another key does can
end it sooner. Each key holds at most `per_key` bindings, and when it opens one
more, its own least recently used binding is forgotten (never another key's), so
a tenant opening sessions in bulk neither evicts anyone else's binding (and then
claims the freed id) nor grows the table past `per_key` x keys. Expired bindings
are dropped when touched, and a key's oldest ones whenever it opens a session.
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
    def __init__(self, per_key: int = 10_000, ttl_s: float = 3600.0):
        if per_key < 1:
            raise ValueError(f"per_key must be >= 1, got {per_key}")
        self.per_key, self.ttl_s = per_key, ttl_s
        self._d: dict[str, Session] = {}
        self._by_owner: dict[str, OrderedDict[str, None]] = {}  # owner -> its session ids, least recent first

    def __len__(self) -> int:
        return len(self._d)

    def owned(self, owner: str) -> int:
        lru = self._by_owner.get(owner)
        return len(lru) if lru is not None else 0

    def get(self, session: str, owner: str, now: float) -> Session | None:
        """The session (created for `owner` if new); None when another key owns it."""
        s = self._d.get(session)
        if s is not None and now - s.last_used > self.ttl_s:
            self._forget(session, s.owner)
            s = None
        if s is None:
            s = self._d[session] = Session(owner, None, now)
            lru = self._by_owner.setdefault(owner, OrderedDict())
            lru[session] = None
            self._trim(owner, lru, now)
        elif s.owner != owner:
            return None
        else:
            self._by_owner[owner].move_to_end(session)
        s.last_used = now
        return s

    def _trim(self, owner: str, lru: OrderedDict[str, None], now: float) -> None:
        """Drop the owner's bindings past its quota, and its expired ones, oldest first."""
        while lru:
            oldest = next(iter(lru))
            if len(lru) <= self.per_key and now - self._d[oldest].last_used <= self.ttl_s:
                return
            self._forget(oldest, owner)

    def _forget(self, session: str, owner: str) -> None:
        del self._d[session]
        lru = self._by_owner[owner]
        del lru[session]
        if not lru:
            del self._by_owner[owner]
