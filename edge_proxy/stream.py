"""One request's life at the proxy: relay, bookkeeping, and exact resume.

A `Stream` is registered on one replica connection at a time. It keeps every
token id received so far (`ids`): on failover the next replica gets the same
prompt ids, sampling and seed plus `resume_ids = ids`, and continues at the
absolute position `len(ids)`, so seeded and greedy streams continue exactly, and
the client, which has seen exactly the text of `ids`, sees neither a gap nor a
repeat. Tokens that the lost replica may have produced but never delivered are
simply produced again.

Sinks (the client side) are duck-typed: `delta(stream, text, ntokens)` on the hot
path and `finish(stream, msg)` with a public `Done` or `Error` once. A `rich` sink
(the OpenAI API) gets `tokens(stream, msg)` with every Tokens and Finished message
instead of `delta` (sample index, logprobs).

n > 1 samples: each sample's tokens are kept (`samples`, sample 0's list is `ids`);
the stream ends once every sample finished, and a failover resends the samples
still running with their tokens (`Generate.sample_ids`, `sample_resume`).
"""

from __future__ import annotations

from wire import protocol as rp
from edge_proxy import protocol as pp


class Stream:
    __slots__ = ("proxy", "cid", "key", "sink", "gen", "hashes", "session", "t0", "t_first", "t_last", "ids",
                 "conn", "rid", "tried", "failovers", "faults", "done", "span", "replica_ttft_ms", "placement",
                 "messages", "rich", "samples", "running", "cached_tokens")

    def __init__(self, proxy, cid: str, key, sink, gen: rp.Generate, hashes: list[int], session, t0: float, span,
                 rich: bool = False):
        self.proxy = proxy
        self.cid = cid  # client's id (public protocol) or the HTTP response id
        self.key = key  # ApiKey
        self.sink = sink
        self.gen = gen  # template for every attempt: prompt ids, sampling (with seed), salt, priority
        self.hashes = hashes  # chained block hashes of the prompt
        self.session = session  # sessions.Session or None
        self.placement: str | None = None  # rendezvous key of the session
        self.messages: list[dict] | None = None  # the chat, to check how its reply re-renders
        self.t0 = t0
        self.t_first = 0.0
        self.t_last = 0.0
        self.ids: list[int] = []
        self.conn = None  # ReplicaConn while registered
        self.rid = ""  # internal id on that connection
        self.tried: set[str] = set()
        self.failovers = 0
        self.faults = 0  # replicas lost or failed while serving it (poison-pill detection)
        self.done = False
        self.span = span
        self.replica_ttft_ms = 0.0
        self.cached_tokens = 0  # what the replica's first Tokens said its cache served (a cancel's done reports it)
        self.rich = rich
        n = gen.sampling.n
        self.samples = [self.ids] + [[] for _ in range(n - 1)] if n > 1 else None
        self.running = set(range(n))  # samples not finished

    # -- from the replica (hot path) -------------------------------------------

    def on_tokens(self, msg, now: float) -> None:
        """A Tokens message, or the last tokens of a Finished one."""
        ids = msg.ids
        if type(msg) is rp.Tokens and msg.cached_tokens:  # (a Finished carries its usage instead)
            self.cached_tokens = msg.cached_tokens
        if self.samples is None:
            self.ids += ids
        else:
            self.samples[msg.index] += ids
        m = self.proxy.metrics
        if self.t_last:
            m.itl.observe(now - self.t_last)
        else:
            self.t_first = now
            m.ttft.observe(now - self.t0)
        self.t_last = now
        m.tokens.inc(by=len(ids))
        if self.rich:
            self.sink.tokens(self, msg)
        else:
            self.sink.delta(self, msg.text, len(ids))

    def on_finished(self, msg: rp.Finished, now: float) -> None:
        if msg.finish_reason == rp.FINISH_ABORT:
            # We did not ask for it (we forget a stream before aborting it): the replica
            # dropped the request, e.g. while shutting down. Resume it elsewhere.
            if msg.ids or msg.text:  # the tokens count; the finish does not
                self.on_tokens(rp.Tokens(msg.id, msg.ids, msg.text, msg.index, msg.logprobs), now)
            self.proxy.replica_dropped(self, "abort")
            return
        if msg.ids or msg.text or self.rich:
            self.on_tokens(msg, now)
        self.running.discard(msg.index)
        if self.running:
            return  # other samples still running
        self.replica_ttft_ms = msg.ttft_ms
        self.proxy.finish(self, msg.finish_reason, msg.usage)

    def on_replica_error(self, err: rp.Error) -> None:
        self.proxy.replica_error(self, err)

    # -- from the client -------------------------------------------------------

    def cancel(self, notify: bool) -> None:
        """Client cancel (`notify`: answer with done/abort) or disconnect (nothing to answer)."""
        if self.done:
            return
        if notify:
            self.proxy.finish(self, rp.FINISH_ABORT, rp.Usage())
        else:
            self.proxy.end(self, "disconnect")

    # -- attempts --------------------------------------------------------------

    def route_key(self) -> str:
        """Names the request for the router's tie-breaks: its first block (the same
        conversation or system prompt draws alike on every proxy worker)."""
        return str(self.hashes[0]) if self.hashes else self.cid

    def next_generate(self, deadline_ms: float) -> rp.Generate:
        """The Generate for the next attempt (the connection fills in the id)."""
        g = self.gen
        if self.samples is None or not self.t_first:
            return rp.Generate("", g.prompt_ids, g.sampling, g.cache_salt, g.priority, deadline_ms,
                               list(self.ids), g.traceparent)
        run = sorted(self.running)
        return rp.Generate("", g.prompt_ids, g.sampling, g.cache_salt, g.priority, deadline_ms, [], g.traceparent,
                           sample_ids=run, sample_resume=[list(self.samples[i]) for i in run])

    def settle(self, eos: frozenset) -> str:
        """Before a resume: mark the samples whose tokens show they ended (max_tokens, EOS);
        the finish reason once none is left, else ""."""
        sp = self.gen.sampling
        reason = ""
        for i in sorted(self.running):
            ids = self.ids if self.samples is None else self.samples[i]
            if len(ids) >= sp.max_tokens:
                reason = rp.FINISH_LENGTH
            elif ids and ids[-1] in eos and not sp.ignore_eos:
                reason = rp.FINISH_STOP
            else:
                continue
            self.running.discard(i)
        return "" if self.running else reason

    def done_message(self, finish_reason: str, usage: rp.Usage, now: float) -> pp.Done:
        return pp.Done(
            id=self.cid, finish_reason=finish_reason,
            usage=pp.Usage(len(self.gen.prompt_ids), sum(map(len, self.samples)) if self.samples else len(self.ids),
                           usage.cached_tokens or self.cached_tokens, usage.accepted_draft_tokens),
            timing=pp.Timing(round((self.t_first - self.t0) * 1e3, 3) if self.t_first else 0.0,
                             round((now - self.t0) * 1e3, 3), round(self.replica_ttft_ms, 3)),
            region=self.proxy.cfg.region, replica=self.conn.id if self.conn is not None else "",
            failovers=self.failovers)
