"""Session table: which API key owns a session id. Nothing about where it ran.

A session's requests are routed by what every proxy of a region sees alike
(`routing`: its placement key for a first turn, the replicas' KV events for a
later one), never by a table of this process: the table holds only owners.

A session id is namespaced by the key that uses it: its placement key
(`placement_key`: key id / session id) is what routing sees, so on every proxy and
worker of the region, whatever it has seen, another key's requests under the same
id are another session (placed apart, their cache salt their tenant's); nothing
they do reaches or moves this key's conversation. On top, the process that first
saw the id binds it to that key and answers another key `forbidden` (a courtesy
of one process: another proxy that never saw the binding serves that key's
requests as its own session, never as this one).

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
            s = self._d[session] = Session(owner, now)
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
