"""The client side of a proxied request: the interfaces its sink implements.

Every sink is a `DeltaSink`: text deltas on the hot path, then exactly one `finish`
with a public `Done` or `Error` (none after a disconnect). A sink that is also a
`TokenSink` (the OpenAI API: sample index, logprobs, every Finished) gets each of the
replica's Tokens and Finished messages through `tokens` instead of `delta`; which one a
`stream.ProxiedRequest` calls is fixed by its sink's type when it is made. A request
forwarded to a peer region (`peering.Forwarded`) has only text, so it calls `delta`
on either kind.

A sink sees the request it serves as a `Served`: its client id, and the token ids
received so far (a resumable client's deltas carry them); requests are hashable by
identity, so a sink may key its state by them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from edge_proxy import protocol as pp
from wire import protocol as P


class Served(Protocol):
    """A request as its sink sees it (`stream.ProxiedRequest` or `peering.Forwarded`)."""

    cid: str
    ids: list[int]


class DeltaSink(Protocol):
    def delta(self, s: Served, text: str, ntok: int) -> None:
        """`ntok` more tokens of `s` (the last `ntok` of `s.ids`) whose text is `text`."""

    def finish(self, s: Served, msg: pp.Done | pp.Error) -> None:
        """`s` ended: its one Done or Error."""


@runtime_checkable
class TokenSink(DeltaSink, Protocol):
    def tokens(self, s: Served, msg: P.Tokens | P.Finished) -> None:
        """A replica's message for `s` as it came (every Finished too, with or without tokens)."""
