"""The proxy core: admit a request, route it, follow it to the end, fail it over.

Everything socket-facing (the ASGI endpoints, the replica pool) calls in here;
the decisions themselves are the pure functions of `routing` and `admission`.

    submit: draining? -> in-flight caps (this process's, the key's share) -> rate limit (the
            key's share) -> size limits (`limits`: bytes, messages, roles; before any work) ->
            sampling bounds (seed assigned) -> session id (namespaced by the key) -> tokenize (thread pool, never on the loop) -> length
            limits -> block hashes -> route (sticky | prefix | load) -> admission
            (deadline, from the replica's Load) -> Generate
    no replica ready here (and the request was not itself forwarded): forward it to the
            nearest peer region's proxy (`peering.PeerLink`), whose done names both regions
    follow it: the replica pool hands every message about a request here (`on_tokens`,
            `on_finished`, `on_replica_error`, `on_lost`: `pool.RequestEvents`), and
            the client's cancel comes here (`cancel`); the request itself
            (`stream.ProxiedRequest`) is state and its sink, and never calls back
    replica lost / dropped / overloaded: resume on another replica with the tokens
            so far (`failover`), or park the stream until one is ready again
    poison pill: a request a replica rejected as malformed (bad_request) or names as the
            cause of an engine failure (engine_fault) is failed, never retried; one that
            was on two replicas when they failed (lost, or engine died: internal) is failed
            too rather than spread to a third
    finish / fail / end: answer the sink (not on disconnect), release the replica
            slot (Abort unless the replica finished it), close the span
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from time import perf_counter

import msgspec

from edge_proxy import protocol as pp
from edge_proxy.admission import admit, predict_ttft_ms
from edge_proxy.disagg import Disagg
from edge_proxy.discovery import DnsDiscovery, ProxyCensus
from edge_proxy.handoff import Handoff
from edge_proxy.limits import RegionShare, check_key_inflight, check_prompt, check_prompt_tokens, check_session_id
from edge_proxy.metrics import ProxyMetrics
from edge_proxy.peering import Forwarded, PeerLink
from edge_proxy.pool import ReplicaPool
from edge_proxy.prompt import TokenizerPool
from edge_proxy.routing import LOAD, Candidate, Decision, later_turn, make_router, mark_home
from edge_proxy.sessions import placement_key
from edge_proxy.sinks import DeltaSink, TokenSink
from edge_proxy.stream import ProxiedRequest
from edge_proxy.throttle import FailedAuthThrottle
from edge_proxy.tracing import console_processor, make_tracer, otlp_processor, start_request_span, traceparent_of
from wire import protocol as P
from wire.hashing import block_hashes
from wire.openai import Fim

log = logging.getLogger("edge_proxy")

MAX_REPLICA_FAULTS = 2  # replicas a request may be on when they fail before it is failed, never spread further
LOSS_GRACE_S = 0.02  # wait after losing a replica before moving its streams (see _on_lost)
REPLACES = "replaces"  # routing reason: the replica of the request a `generate` replaces
_REPLICA_CODES = {P.BAD_REQUEST, P.PROMPT_TOO_LONG, P.OVERLOADED, P.INTERNAL, P.NOT_FOUND}
_PRIORITY_NAMES = {v: k for k, v in pp.PRIORITIES.items()}


@dataclass(slots=True)
class SubmitRequest:
    """A generate request from either front end, before tokenization."""

    cid: str
    messages: list[dict] | None = None
    prompt: str | list[int] | Fim | None = None  # text, token ids (OpenAI API) or fill-in-the-middle
    session: str | None = None
    sampling: pp.Sampling | P.SamplingParams | None = None  # the public protocol's, or the OpenAI API's
    priority: str | None = None
    deadline_ms: float = 0.0
    traceparent: str | None = None
    forwarded_by: str | None = None  # X-Edgechat-Forwarded-By: a peer region's proxy sent it; never forward it on
    tenant: str | None = None  # set by a peer region's proxy (peer keys only): run as this tenant
    ids: list[int] | None = None  # the prompt already tokenized (OpenAI API); messages/prompt kept for forwarding
    cache_salt: str = ""  # the client's own salt, within its tenant's (OpenAI `cache_salt`)
    tools: object = None  # wire.tools.Tools rendered into the prompt (messages), or None
    resume: list[int] | None = None  # token ids the client already has: continue after them (exact, as failover)
    resumable: bool = False  # the client wants token ids in its deltas (kept when forwarded to a peer)
    prefer: str | None = None  # replica id to place it on when ready (the one the request it replaces ran on)


class Proxy:
    def __init__(self, cfg, tokenizer, keys, metrics: ProxyMetrics | None = None, tracer=None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.keys = keys
        self.metrics = metrics or ProxyMetrics()
        self.tracer = tracer or make_tracer(cfg.region, ([console_processor()] if cfg.otel_console else [])
                                            + ([otlp_processor()] if cfg.otel_otlp else []))
        self.router = make_router(cfg.router)
        self.tokenizers = TokenizerPool(tokenizer, cfg.limits.tokenizer_threads, cfg.limits.max_tokenizing)
        self.auth_throttle = FailedAuthThrottle(cfg.auth_failures_per_s, cfg.auth_failure_burst)
        self.pool = ReplicaPool(cfg.replicas, cfg.pool, self, getattr(tokenizer, "fingerprint", ""))
        self.pool.state_listeners.append(self._on_pool_change)
        self.discovery = DnsDiscovery(cfg.discovery, self.pool, self.metrics) if cfg.discovery else None
        # Each key's limits are the region's: this process enforces its share (`limits.RegionShare`).
        self.region = RegionShare(cfg.region_proxies, cfg.workers)
        self.keys.set_share(self.region.fraction)
        self.census = ProxyCensus(cfg.proxies_dns, self._on_proxies, cfg.region_proxies) if cfg.proxies_dns else None
        self.key_inflight: dict[str, int] = {}  # ApiKey.key_id -> its requests in flight on this process
        self.streams: set[ProxiedRequest] = set()
        self.forwarding: set[Forwarded] = set()  # requests relayed to a peer region, until their end
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._parked: dict[ProxiedRequest, tuple[str, asyncio.TimerHandle]] = {}
        self._eos = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ())
        self.peers = PeerLink(cfg.region, list(cfg.peers), cfg.peer_key or None) if cfg.peers else None
        self.handoff = Handoff(self, cfg.handoff_budget_s, hot_blocks=cfg.handoff_hot_blocks)  # a draining replica's streams, moved with their KV
        self.disagg = Disagg(self, cfg.disagg_min_blocks)  # cold prompts of decode-role replicas, prefilled on a prefill-role one

    async def start(self) -> None:
        await self.pool.start()
        if self.discovery is not None:
            self.discovery.start()
        if self.census is not None:
            self.census.start()

    def _on_proxies(self, n: int) -> None:
        """The region now runs `n` proxy pods: every key's share changes."""
        self.region = RegionShare(n, self.cfg.workers)
        self.keys.set_share(self.region.fraction)

    def fail_all(self, code: str, message: str) -> None:
        """End every open request with an error frame (streams and requests forwarded to peers)."""
        for s in list(self.streams):
            self._fail(s, code, message)
        for f in list(self.forwarding):
            if not f.done:
                f.cancel(notify=False)  # stops it at the peer too
                f.sink.finish(f, pp.Error(code, message, f.cid))

    async def stop(self) -> None:
        self.fail_all(pp.SHUTTING_DOWN, "the proxy is shutting down")
        if self.peers is not None:
            await self.peers.close()
        if self.discovery is not None:
            await self.discovery.stop()
        if self.census is not None:
            await self.census.stop()
        await self.disagg.close()
        await self.pool.stop()
        self.tokenizers.close()

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests and wait for open streams to finish; False on timeout."""
        self.draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    # -- admission -------------------------------------------------------------

    def authenticate(self, token: str | None, addr: str | None):
        """The API key of a handshake or HTTP request from source address `addr`. Raises
        `unauthorized`, or `rate_limited` while `addr` has failed too often (key not checked)."""
        wait = self.auth_throttle.wait_s(addr)
        if wait > 0:
            raise pp.ProtocolError(pp.RATE_LIMITED, "too many failed authentications from this address",
                                   round(max(wait, 0.001), 3))
        key = self.keys.check(token)
        if key is None:
            self.auth_throttle.failed(addr)
            raise pp.ProtocolError(pp.UNAUTHORIZED, "missing or unknown API key")
        return key

    def _check_open(self) -> None:
        if self.draining:
            raise pp.ProtocolError(pp.SHUTTING_DOWN, "the proxy is draining; retry on another proxy", 1.0)
        if len(self.streams) + len(self.forwarding) >= self.cfg.admission.max_inflight:
            raise pp.ProtocolError(pp.OVERLOADED, f"proxy at its limit of {self.cfg.admission.max_inflight} "
                                                  "requests in flight", 1.0)

    def _sampling(self, s: pp.Sampling | P.SamplingParams) -> P.SamplingParams:
        sp = msgspec.structs.replace(s) if isinstance(s, P.SamplingParams) else s.params()  # our own copy
        err = sp.validate(self.cfg.max_tokens_limit)
        if err is not None:
            raise pp.ProtocolError(pp.BAD_REQUEST, err)
        if sp.seed is None:  # fixed at arrival, so a resumed stream samples exactly as the first attempt would
            sp.seed = secrets.randbits(63)
        return sp

    @staticmethod
    def _priority(key, requested: str | None) -> int:
        if requested is None:
            return key.priority
        p = pp.PRIORITIES.get(requested)
        if p is None:
            raise pp.ProtocolError(pp.BAD_REQUEST, f"priority must be one of {sorted(pp.PRIORITIES)}, got {requested!r}")
        return max(p, key.priority)  # a key never gets above its tier

    async def submit(self, key, req: SubmitRequest, sink: DeltaSink | TokenSink) -> ProxiedRequest | Forwarded:
        """Admit, route and start a request (or forward it to a peer region); raises
        `ProtocolError` when refused."""
        t0 = perf_counter()
        try:
            if req.tenant is not None:
                try:
                    key = self.keys.on_behalf_of(key, req.tenant)
                except PermissionError as e:
                    raise pp.ProtocolError(pp.FORBIDDEN, str(e)) from None
            self._check_open()
            check_key_inflight(self.key_inflight.get(key.key_id, 0), key.inflight_cap, key.key_id)
            wait = key.bucket.take() if key.bucket is not None else 0.0
            if wait > 0:
                raise pp.ProtocolError(pp.RATE_LIMITED, f"rate limit of API key {key.key_id} exceeded",
                                       round(max(wait, 0.001), 3))
            if req.ids is None:  # (the OpenAI API checks and tokenizes its prompts itself: `tokenize_plan_prompt`)
                check_prompt(req.messages, req.prompt, self.cfg.limits)
            sampling = self._sampling(req.sampling or pp.Sampling())
            priority = self._priority(key, req.priority)
            if req.session is not None:
                check_session_id(req.session)
            if self._forwardable(req, sampling):
                return self._forward(key, req, sampling, priority, sink, t0)
            ids = req.ids if req.ids is not None else await self._tokenize(req.messages, req.prompt, req.tools)
            check_prompt_tokens(len(ids), sampling.max_tokens, self.cfg.max_prompt_tokens, self.pool.max_model_len)
            self._check_open()  # draining may have begun while tokenizing
            bs = self.pool.block_size
            if not bs:
                raise pp.ProtocolError(pp.UNAVAILABLE, "no replica has connected yet", 1.0)
        except pp.ProtocolError as e:
            self.metrics.rejected.inc(e.code)
            raise
        salt = key.cache_salt + "/" + req.cache_salt if req.cache_salt else key.cache_salt
        hashes = block_hashes(ids, bs, salt)
        span = start_request_span(self.tracer, req.traceparent, {
            "edgechat.tenant": key.tenant, "edgechat.prompt_tokens": len(ids), "edgechat.priority": priority})
        gen = P.Generate("", ids, sampling, salt, priority, 0.0, [], traceparent_of(span))
        s = ProxiedRequest(req.cid, key, sink, gen, hashes, req.session, t0, span)
        s.messages = req.messages
        s.later = later_turn(req.messages, req.session)
        if req.session is not None:  # namespaced by the key, on every proxy alike (`sessions`)
            s.placement = placement_key(key.key_id, req.session)
        if req.resume:
            s.ids += req.resume  # as after a failover: the replica continues at len(ids), the client has their text
            ended = s.settle(self._eos)
            if ended:  # nothing left to generate (the client missed only the done)
                self._add_stream(s)
                self._count_inflight()
                self._finish(s, ended, P.Usage())
                return s
        try:
            self._place_new(s, req.deadline_ms, req.prefer)
        except pp.ProtocolError as e:
            if e.code == pp.UNAVAILABLE and self._forwardable(req, sampling):  # the replicas went while tokenizing
                span.end()
                return self._forward(key, req, sampling, priority, sink, t0)
            self.metrics.rejected.inc(e.code)
            span.set_attribute("edgechat.rejected", e.code)
            span.end()
            raise
        self._add_stream(s)
        self._count_inflight()
        self.metrics.prompt_tokens.inc(by=len(ids))
        self._idle.clear()
        return s

    async def _tokenize(self, messages: list[dict] | None, prompt: str | None, tools=None) -> list[int]:
        try:
            return await self.tokenizers.encode(messages, prompt, tools)
        except ValueError as e:  # replica.tokenizer.ChatTemplateError, or a tokenizer refusing the text
            raise pp.ProtocolError(pp.BAD_REQUEST, f"cannot render or tokenize the prompt: {e}") from None

    def _forwardable(self, req: SubmitRequest, sp: P.SamplingParams) -> bool:
        return (self.peers is not None and not req.forwarded_by and not self.pool.ready()
                and not isinstance(req.prompt, list)  # token ids are this model's; the public protocol takes text
                and not req.cache_salt and sp.n == 1 and sp.logprobs is None and sp.prompt_logprobs is None
                and not sp.grammar and req.tools is None)  # the public protocol's sampling carries no grammar

    def _forward(self, key, req: SubmitRequest, sampling: P.SamplingParams, priority: int, sink,
                 t0: float) -> Forwarded:
        kw = {f: getattr(sampling, f) for f in pp.Sampling.__struct_fields__}  # the public protocol's sampling
        kw.update(messages=req.messages, prompt=req.prompt, session=req.session,
                  priority=_PRIORITY_NAMES.get(priority), traceparent=req.traceparent, resumable=req.resumable,
                  resume=req.resume or None)
        if isinstance(req.prompt, Fim):
            kw.update(prompt=None, prefix=req.prompt.prefix, suffix=req.prompt.suffix)
        if self.cfg.peer_key:  # the peer runs it as this tenant (our key there is a peer key)
            kw["tenant"] = key.tenant
        if req.deadline_ms > 0:
            kw["deadline_ms"] = max(req.deadline_ms - (perf_counter() - t0) * 1e3, 1.0)
        self.metrics.routing.inc("forwarded")
        f = self.peers.forward(req.cid, sink, kw)
        f.t0 = t0
        self.forwarding.add(f)  # in flight here too: counted against max_inflight, waited for by drain
        self._count_inflight()
        self._idle.clear()
        f.task.add_done_callback(lambda _: self._forward_ended(f))
        return f

    def _forward_ended(self, f: Forwarded) -> None:
        self.forwarding.discard(f)
        self._count_inflight()
        if not self.streams and not self.forwarding:
            self._idle.set()

    # -- routing ---------------------------------------------------------------

    def _candidates(self, s: ProxiedRequest, conns) -> list[Candidate]:
        return self._candidates_for(s.hashes, s.later, conns)

    def _candidates_for(self, hashes: list[int], later: bool, conns) -> list[Candidate]:
        now = perf_counter()
        rates = {c.id: c.load.tokens_per_s for c in conns if c.load is not None and c.load.tokens_per_s > 0}
        mean = sum(rates.values()) / len(rates) if rates else 0.0
        out = []
        for c in conns:
            n = c.index.match(hashes, now)
            out.append(Candidate(c.id, c.effective_load(), n, c.prefill_pending, len(c.prefilling),
                                 rates[c.id] / mean if c.id in rates else 1.0, c.group, c.share, len(c.index),
                                 chains=c.chains()))
        mark_home(out, later)  # from the replicas' KV events and the request: alike on every proxy
        return out

    def _place_new(self, s: ProxiedRequest, deadline_ms: float, prefer: str | None = None,
                   colocated: bool = False) -> None:
        conns = self.pool.ready()
        if not conns:
            raise pp.ProtocolError(pp.UNAVAILABLE, "no replica is ready", 1.0)
        cands = self._candidates(s, conns)
        by_id = {c.id: c for c in conns}
        if prefer in by_id:  # `replaces`: the replica that ran the old request holds its prefix and its slot
            d = Decision(prefer, REPLACES, next(c.cached_blocks for c in cands if c.id == prefer))
        else:
            # A session's replica is its home as the replicas' KV events show it (`mark_home`), never
            # where this process last sent it: every proxy of the region finds the same one.
            home = next((c.id for c in cands if c.history), None)
            d = self.router.route(cands, len(s.gen.prompt_ids), self.pool.block_size, key=s.route_key(),
                                  session_key=s.placement, session_current=home, new=not s.later)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %s session=%s prompt=%d -> %s (%s) among %s", s.cid, s.placement,
                      len(s.gen.prompt_ids), d.replica, d.reason,
                      " ".join(f"{c.id}:load={c.load:g},cached={c.cached_blocks},queued={c.queued_prefill},"
                               f"held={c.held_blocks},chains={c.chains}{',history' if c.history else ''}" for c in cands))
        conn = by_id[d.replica]
        if deadline_ms > 0 or s.gen.priority >= P.BATCH:
            conn, d = self._admit(s, cands, by_id, d, deadline_ms)
        if colocated or not self.disagg.take(s, conn, d, deadline_ms):  # (a decode replica's cold prompt: not yet)
            remaining = max(deadline_ms - (perf_counter() - s.t0) * 1e3, 1.0) if deadline_ms > 0 else 0.0
            self._attach(s, conn, d, remaining)

    def prefilled(self, s: ProxiedRequest, conn, d: Decision, deadline_ms: float) -> None:
        """`s`'s prompt was prefilled elsewhere for `conn` (`disagg`; d.cached_blocks: the blocks it holds now,
        whether the hand-off worked or not): start its stream there, or placed anew if `conn` went meanwhile."""
        if s.done:
            return  # cancelled or failed meanwhile
        if not conn.ready:
            try:
                self._place_new(s, deadline_ms, colocated=True)
            except pp.ProtocolError as e:
                self._fail(s, e.code, e.message)
            return
        remaining = max(deadline_ms - (perf_counter() - s.t0) * 1e3, 1.0) if deadline_ms > 0 else 0.0
        self._attach(s, conn, d, remaining)

    def _admit(self, s: ProxiedRequest, cands, by_id, d: Decision, deadline_ms: float):
        cfg, bs, n = self.cfg.admission, self.pool.block_size, len(s.gen.prompt_ids)

        def predict(c: Candidate) -> float:
            return predict_ttft_ms(by_id[c.id].load_view(), n - c.cached_blocks * bs, cfg)

        chosen = next(c for c in cands if c.id == d.replica)
        v = admit(predict(chosen), deadline_ms, s.gen.priority, cfg)
        if v.ok:
            return by_id[d.replica], d
        best = min(cands, key=predict)
        v2 = admit(predict(best), deadline_ms, s.gen.priority, cfg)
        if not v2.ok:
            raise pp.ProtocolError(pp.OVERLOADED, v.reason, v2.retry_after_s)
        return by_id[best.id], Decision(best.id, LOAD, best.cached_blocks)

    def _attach(self, s: ProxiedRequest, conn, d: Decision, deadline_ms: float) -> None:
        s.conn = conn
        s.tried.add(conn.id)
        gen = s.next_generate(deadline_ms)
        # a new conversation, a chain of its own there: the replica counts it (Load.chains) from the moment it has it
        gen.new_chain = not s.later and not s.ids and d.cached_blocks < len(s.hashes)
        s.rid = conn.start(s, gen, max(len(s.gen.prompt_ids) - d.cached_blocks * self.pool.block_size, 1))
        conn.index.expect(s.hashes, perf_counter())
        m = self.metrics
        m.routing.inc(d.reason)
        m.prefix_blocks.inc(by=len(s.hashes))
        m.prefix_blocks_hit.inc(by=d.cached_blocks)
        s.span.add_event("route", {"replica": conn.id, "reason": d.reason, "cached_blocks": d.cached_blocks,
                                   "resume_tokens": len(s.ids)})

    # -- what the replicas say about a request (pool.RequestEvents; the hot path) --

    def on_tokens(self, s: ProxiedRequest, msg: P.Tokens | P.Finished, now: float) -> None:
        """A Tokens message, or the last tokens of a Finished one."""
        m = self.metrics
        if s.t_last:
            m.itl.observe(now - s.t_last)
        else:
            m.ttft.observe(now - s.t0)
        m.generation_tokens.inc(len(msg.ids))
        s.add_tokens(msg, now)
        if self.handoff.awaiting:  # a draining replica's stream moves right after its next token
            self.handoff.on_tokens(s)

    def on_finished(self, s: ProxiedRequest, msg: P.Finished, now: float) -> None:
        if msg.finish_reason == P.FINISH_ABORT:
            # We did not ask for it (we forget a request before aborting it): the replica
            # dropped the request, e.g. while shutting down. Resume it elsewhere.
            if msg.ids or msg.text:  # the tokens count; the finish does not
                self.on_tokens(s, P.Tokens(msg.id, msg.ids, msg.text, msg.index, msg.logprobs), now)
            self._replica_dropped(s, "abort")
            return
        if msg.ids or msg.text or s.token_sink is not None:  # a token sink sees every Finished
            self.on_tokens(s, msg, now)
        if not s.sample_finished(msg.index):
            return  # other samples still running
        s.replica_ttft_ms = msg.ttft_ms
        self._finish(s, msg.finish_reason, msg.usage)
        if self.handoff.awaiting:  # a hand-off waiting for this stream's next token: there is none
            self.handoff.on_tokens(s)

    def on_replica_error(self, s: ProxiedRequest, err: P.Error) -> None:
        """Internal (the replica's engine died under it): like losing that replica. Overloaded:
        try another. Anything else (bad_request, engine_fault...) is the request's own: fail it."""
        if err.code == P.INTERNAL:
            failed = s.conn.id
            s.conn.release(s.rid, abort=False)
            s.conn = None
            s.faults += 1
            self._resume(s, "replica_internal", avoid=failed)
            return
        retry = (err.code == P.OVERLOADED and s.failovers < self.cfg.failover_attempts
                 and any(c.id not in s.tried for c in self.pool.ready()))
        if retry:
            s.conn.release(s.rid, abort=False)
            s.conn = None
            self._resume(s, f"replica_{err.code}")
            return
        self._fail(s, err.code if err.code in _REPLICA_CODES else pp.INTERNAL, f"replica: {err.message}")

    # -- what the client says --------------------------------------------------

    def cancel(self, s: ProxiedRequest | Forwarded, notify: bool) -> None:
        """Client cancel (`notify`: answer with done/abort) or disconnect (nothing to answer)."""
        if type(s) is Forwarded:
            s.cancel(notify)
        elif s.done:
            return
        elif notify:
            self._finish(s, P.FINISH_ABORT, P.Usage())
        else:
            self._end(s, "disconnect")

    # -- failover --------------------------------------------------------------

    def on_lost(self, conn, streams: list[ProxiedRequest], cause: str) -> None:
        for s in streams:
            s.conn = None
            if cause != "removed":  # taken out of discovery on purpose: nothing the request could have caused
                s.faults += 1
        # Replicas lost together (a host or a region going down) are seen one socket at a time:
        # move the streams a beat later, when every replica lost in the same moment is out of the
        # choice, so none is sent to a dying replica and blamed for failing there too.
        asyncio.get_running_loop().call_later(LOSS_GRACE_S, self._resume_all, streams, cause)

    def on_draining(self, conn, streams: list[ProxiedRequest]) -> None:
        """`conn` drains (its Load says so): its streams move with their KV (`handoff`), each by `hand_off`."""
        self.handoff.drain(conn, streams)

    def successor(self, s: ProxiedRequest) -> Decision | None:
        """Where a draining replica's stream goes: placed as failover places one, among the ready replicas."""
        conns = self.pool.ready()
        return self.router.route(self._candidates(s, conns), len(s.gen.prompt_ids), self.pool.block_size,
                                 key=s.route_key(), failover=True) if conns else None

    def chain_home(self, hashes: list[int], tokens: int) -> Decision | None:
        """Where a draining replica's hot chain (a cached conversation no stream holds) goes: where its next
        turn would be placed among the ready replicas (its first block names it, as a request's does)."""
        conns = self.pool.ready()
        return self.router.route(self._candidates_for(hashes, True, conns), tokens, self.pool.block_size,
                                 key=str(hashes[0]), failover=True) if conns and hashes else None

    def hand_off(self, s: ProxiedRequest, draining, d: Decision) -> None:
        """Move a stream off its draining replica to `d.replica`, its KV pulled there (or not: recomputed)
        exactly as failover moves one (a resume with the ids so far), and abort it on the draining one."""
        if s.done or s.conn is not draining:
            return  # finished, failed, or its replica was lost and it failed over meanwhile
        draining.release(s.rid, abort=True)
        s.conn = None
        conn = next((c for c in self.pool.ready() if c.id == d.replica), None)
        if conn is None:  # the successor went away during the pull
            self._resume(s, "drain")
            return
        ended = s.settle(self._eos)
        if ended:
            self._finish(s, ended, P.Usage())
            return
        s.failovers += 1
        self.metrics.failovers.inc("drain")
        self.metrics.handoff_tokens.inc(by=len(s.gen.prompt_ids) + len(s.ids))
        s.span.add_event("failover", {"cause": "drain", "resume_tokens": len(s.ids), "cached_blocks": d.cached_blocks})
        self._attach(s, conn, d, 0.0)

    def _resume_all(self, streams: list[ProxiedRequest], cause: str) -> None:
        for s in streams:
            self._resume(s, cause)

    def _replica_dropped(self, s: ProxiedRequest, cause: str) -> None:
        """The replica ended a request we did not end (unsolicited abort): move it."""
        if s.conn is not None:
            s.conn.release(s.rid, abort=False)
            s.conn = None
        self._resume(s, cause)

    def _resume(self, s: ProxiedRequest, cause: str, avoid: str = "") -> None:
        """Move a stream to another replica (`avoid`: one that just failed it, even if it still
        looks ready), or park it until one is ready."""
        if s.done:
            return
        ended = s.settle(self._eos)  # everything was delivered but the Finished
        if ended:
            self._finish(s, ended, P.Usage())
            return
        if s.faults >= MAX_REPLICA_FAULTS:
            self._fail(s, pp.INTERNAL, f"the request was on {s.faults} replicas when they failed (last: {cause}); "
                                      "not retried on another, in case it is what makes them fail")
            return
        if s.failovers >= self.cfg.failover_attempts:
            self._fail(s, pp.UNAVAILABLE, f"stream lost its replica {s.failovers + 1} times; giving up")
            return
        conns = self.pool.ready(exclude=s.tried) or self.pool.ready(exclude={avoid})
        if not conns:
            self._park(s, cause)
            return
        d = self.router.route(self._candidates(s, conns), len(s.gen.prompt_ids), self.pool.block_size,
                              key=s.route_key(), failover=True)
        s.failovers += 1
        log.debug("failover %s (%s) after %d tokens -> %s (%s)", s.cid, cause, len(s.ids), d.replica, d.reason)
        self.metrics.failovers.inc(cause)
        s.span.add_event("failover", {"cause": cause, "resume_tokens": len(s.ids)})
        self._attach(s, next(c for c in conns if c.id == d.replica), d, 0.0)

    def _park(self, s: ProxiedRequest, cause: str) -> None:
        log.debug("park %s (%s) after %d tokens: no replica ready", s.cid, cause, len(s.ids))
        h = asyncio.get_running_loop().call_later(self.cfg.failover_wait_s, self._park_expired, s)
        self._parked[s] = (cause, h)

    def _park_expired(self, s: ProxiedRequest) -> None:
        if self._parked.pop(s, None) is not None:
            self._fail(s, pp.UNAVAILABLE, f"no replica came back within {self.cfg.failover_wait_s:g} s")

    def _on_pool_change(self) -> None:
        if self._parked and self.pool.ready():
            parked, self._parked = self._parked, {}
            for s, (cause, h) in parked.items():
                h.cancel()
                self._resume(s, cause)

    # -- endings ---------------------------------------------------------------

    def _release(self, s: ProxiedRequest, abort: bool) -> None:
        s.done = True
        if s.conn is not None:
            s.conn.release(s.rid, abort)
            if len(s.ids) > 1:  # the replica holds the prompt and what it streamed: the next turn finds it there
                s.conn.index.expect_reply(s.gen.prompt_ids, s.hashes, s.ids, self.pool.block_size,
                                          s.gen.cache_salt, perf_counter())
        parked = self._parked.pop(s, None)
        if parked is not None:
            parked[1].cancel()
        if s in self.streams:
            self.streams.discard(s)
            k = s.key.key_id if s.key is not None else ""
            n = self.key_inflight.get(k, 0)  # (0: a stream not admitted by `submit`, as tests place them)
            if n > 1:
                self.key_inflight[k] = n - 1
            elif n:
                del self.key_inflight[k]
        self._count_inflight()
        if not self.streams and not self.forwarding:
            self._idle.set()

    def _finish(self, s: ProxiedRequest, finish_reason: str, usage: P.Usage) -> None:
        if s.done:
            return
        now = perf_counter()
        self._release(s, abort=finish_reason == P.FINISH_ABORT)
        msg = s.done_message(finish_reason, usage, now, self.cfg.region)
        self.metrics.requests.inc(finish_reason)
        self.metrics.e2e.observe(now - s.t0)
        self.metrics.cached_tokens.inc(by=usage.cached_tokens)
        span = s.span
        span.set_attribute("edgechat.finish_reason", finish_reason)
        span.set_attribute("edgechat.completion_tokens", len(s.ids))
        span.set_attribute("edgechat.cached_tokens", usage.cached_tokens)
        span.set_attribute("edgechat.replica", msg.replica)
        span.set_attribute("edgechat.ttft_ms", msg.timing.ttft_ms)
        span.end()
        s.sink.finish(s, msg)
        if s.messages is not None and len(s.ids) > 1 and finish_reason != P.FINISH_ABORT:
            self.tokenizers.reply_ids(s.messages, s.ids, lambda again: self._check_reply(s, again))

    def _check_reply(self, s: ProxiedRequest, again: list[int]) -> None:
        """Does the chat template render this reply, in the next turn, into the ids the
        replica generated (`again` vs prompt + ids)? Where it does not, the next turn's
        cache match, on any replica, ends at the first differing block: counted and
        logged; the chained block hashes route it on that true match."""
        held = s.gen.prompt_ids + s.ids[:-1]  # the last id was sampled, never computed
        n = next((i for i, (a, b) in enumerate(zip(held, again)) if a != b), len(held))
        if n < len(held):
            bs = self.pool.block_size
            self.metrics.retokenized.inc()
            log.debug("reply re-rendered into other ids at token %d of %d (prompt %d): the next turn's cache "
                      "match ends at block %d instead of %d", n, len(held), len(s.gen.prompt_ids), n // bs,
                      len(held) // bs)

    def _fail(self, s: ProxiedRequest, code: str, message: str) -> None:
        if s.done:
            return
        self._release(s, abort=True)
        self.metrics.requests.inc("error")
        s.span.set_attribute("edgechat.error", code)
        s.span.end()
        s.sink.finish(s, pp.Error(code, message, s.cid))

    def _end(self, s: ProxiedRequest, outcome: str) -> None:
        """The client went away: stop the replica's work, answer nothing."""
        if s.done:
            return
        self._release(s, abort=True)
        self.metrics.requests.inc(outcome)
        s.span.set_attribute("edgechat.finish_reason", outcome)
        s.span.end()

    def _add_stream(self, s: ProxiedRequest) -> None:
        self.streams.add(s)
        self.key_inflight[s.key.key_id] = self.key_inflight.get(s.key.key_id, 0) + 1

    # -- observability ---------------------------------------------------------

    def _count_inflight(self) -> None:
        self.metrics.inflight.set(len(self.streams) + len(self.forwarding))

    def render_metrics(self) -> bytes:
        """Prometheus text: this proxy's metrics (all workers'), its replicas as this worker sees them."""
        return self.metrics.render(self.pool.conns)
