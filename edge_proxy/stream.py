"""One request at the proxy: what it has received, its sink, and what an attempt sends.

A `ProxiedRequest` is registered on one replica connection at a time. It keeps every
token id received so far (`ids`): on failover the next replica gets the same
prompt ids, sampling and seed plus `resume_ids = ids`, and continues at the
absolute position `len(ids)`, so seeded and greedy streams continue exactly, and
the client, which has seen exactly the text of `ids`, sees neither a gap nor a
repeat. Tokens that the lost replica may have produced but never delivered are
simply produced again.

It is per-request state and its sink, nothing more: the replica pool hands every
message about the request to the proxy (`core.Proxy.on_tokens`, `on_finished`,
`on_replica_error`, `on_lost`), which records it here (`add_tokens`) and decides
whether the request finished, failed or moves to another replica; a client's cancel
goes to the proxy too (`Proxy.cancel`). Nothing here calls the proxy.

Sinks (`sinks`): every sink takes `delta(request, text, ntokens)` on the hot path and
`finish(request, msg)` with a public `Done` or `Error` once; a `sinks.TokenSink` (the
OpenAI API) gets `tokens(request, msg)` with every Tokens and Finished message instead
of `delta` (sample index, logprobs). Which one is fixed by the sink's type, here.

n > 1 samples: each sample's tokens are kept (`samples`, sample 0's list is `ids`);
the request ends once every sample finished, and a failover resends the samples
still running with their tokens (`Generate.sample_ids`, `sample_resume`).
"""

from __future__ import annotations

from edge_proxy import protocol as pp
from edge_proxy.sinks import DeltaSink, TokenSink
from wire import protocol as P


class ProxiedRequest:
    __slots__ = ("cid", "key", "sink", "token_sink", "gen", "hashes", "session", "t0", "t_first", "t_last", "ids",
                 "conn", "rid", "tried", "failovers", "faults", "done", "span", "replica_ttft_ms", "placement",
                 "later", "messages", "samples", "running", "cached_tokens")

    def __init__(self, cid: str, key, sink: DeltaSink | TokenSink, gen: P.Generate, hashes: list[int], session,
                 t0: float, span):
        self.cid = cid  # client's id (public protocol) or the HTTP response id
        self.key = key  # ApiKey
        self.sink = sink
        self.token_sink = sink if isinstance(sink, TokenSink) else None  # gets `tokens` instead of `delta`
        self.gen = gen  # template for every attempt: prompt ids, sampling (with seed), salt, priority
        self.hashes = hashes  # chained block hashes of the prompt
        self.session = session  # the session id the client named, or None
        self.placement: str | None = None  # rendezvous key of the session
        self.later = False  # it goes on from an earlier reply (`routing.later_turn`): it may have a home
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
        n = gen.sampling.n
        self.samples = [self.ids] + [[] for _ in range(n - 1)] if n > 1 else None
        self.running = set(range(n))  # samples not finished

    # -- what the replica sent (recorded by the proxy) -------------------------

    def add_tokens(self, msg: P.Tokens | P.Finished, now: float) -> None:
        """A Tokens message, or the last tokens of a Finished one: kept, and relayed to the sink (hot path)."""
        ids = msg.ids
        if type(msg) is P.Tokens and msg.cached_tokens:  # (a Finished carries its usage instead)
            self.cached_tokens = msg.cached_tokens
        if self.samples is None:
            self.ids += ids
        else:
            self.samples[msg.index] += ids
        if not self.t_last:
            self.t_first = now
        self.t_last = now
        if self.token_sink is not None:
            self.token_sink.tokens(self, msg)
        else:
            self.sink.delta(self, msg.text, len(ids))

    def sample_finished(self, index: int) -> bool:
        """Sample `index` finished; True once no sample is left running."""
        self.running.discard(index)
        return not self.running

    # -- attempts --------------------------------------------------------------

    def route_key(self) -> str:
        """Names the request for the router's tie-breaks: its first block (the same
        conversation or system prompt draws alike on every proxy worker)."""
        return str(self.hashes[0]) if self.hashes else self.cid

    def next_generate(self, deadline_ms: float) -> P.Generate:
        """The Generate for the next attempt (the connection fills in the id)."""
        g = self.gen
        if self.samples is None or not self.t_first:
            return P.Generate("", g.prompt_ids, g.sampling, g.cache_salt, g.priority, deadline_ms,
                          list(self.ids), g.traceparent)
        run = sorted(self.running)
        return P.Generate("", g.prompt_ids, g.sampling, g.cache_salt, g.priority, deadline_ms, [], g.traceparent,
                          sample_ids=run, sample_resume=[list(self.samples[i]) for i in run])

    def settle(self, eos: frozenset) -> str:
        """Before a resume: mark the samples whose tokens show they ended (max_tokens, EOS);
        the finish reason once none is left, else ""."""
        sp = self.gen.sampling
        reason = ""
        for i in sorted(self.running):
            ids = self.ids if self.samples is None else self.samples[i]
            if len(ids) >= sp.max_tokens:
                reason = P.FINISH_LENGTH
            elif ids and ids[-1] in eos and not sp.ignore_eos:
                reason = P.FINISH_STOP
            else:
                continue
            self.running.discard(i)
        return "" if self.running else reason

    def done_message(self, finish_reason: str, usage: P.Usage, now: float, region: str) -> pp.Done:
        return pp.Done(
            id=self.cid, finish_reason=finish_reason,
            usage=pp.Usage(len(self.gen.prompt_ids), sum(map(len, self.samples)) if self.samples else len(self.ids),
                           usage.cached_tokens or self.cached_tokens, usage.accepted_draft_tokens),
            timing=pp.Timing(round((self.t_first - self.t0) * 1e3, 3) if self.t_first else 0.0,
                             round((now - self.t0) * 1e3, 3), round(self.replica_ttft_ms, 3)),
            region=region, replica=self.conn.id if self.conn is not None else "",
            failovers=self.failovers)
