"""Sessions: a conversation's id, namespaced by the API key that names it.

A session id means nothing without its key: the session a request belongs to is
(key, id), its placement key (`placement_key`), which is what routing draws on. So
on every proxy and worker of a region, whatever each has seen before, another
key's requests under the same id are another session: placed by another key
(rendezvous), their cache salt their own tenant's, and nothing they do reaches,
claims or moves this key's conversation. No proxy holds a table of sessions: a
session's replica is found from the replicas' KV events (`routing.mark_home`), so
there is nothing to bind, to evict or to lose when a turn lands on another proxy.

(Until issue 44 a process bound an id to the first key it saw use it and answered
others `forbidden`. Each process bound it alone, so with two proxies the id's owner
could be refused on the one where another key had used it first; namespacing by
key gives every proxy the same answer.)
"""

from __future__ import annotations


def placement_key(owner: str, session: str) -> str:
    """The session (`owner`: ApiKey.key_id) as routing sees it."""
    return f"{owner}/{session}"
