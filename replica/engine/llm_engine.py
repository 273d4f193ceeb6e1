"""The engine: requests in, token ids out, one `step()` at a time.

Single-threaded and synchronous; `replica.engine.process` drives it in a busy loop.
It validates requests, schedules, runs the model, samples, checks stop
conditions and frees finished or aborted requests' blocks immediately.
"""

from __future__ import annotations

import bisect
import random
import time
from dataclasses import dataclass, replace

import torch

from wire import protocol as P
from replica.model import sampler
from replica.engine.block_manager import BlockManager
from replica.config import EngineConfig, ModelConfig
from replica.engine.forks import Forks
from replica.engine.grammar import Grammars
from replica.model.plan import placeholder, plan_step
from replica.model.calibration import calibration_prompts
from replica.model.runner import Runner
from replica.engine.scheduler import Scheduler
from replica.engine.sequence import Sequence, Status
from replica.model.tp import TensorParallel
from replica.validation import check_for_model, check_generate

# Steps computing at least this many prompt tokens time the prefill rate reported in Load
# (`tokens_per_s`; the proxy prices queued prefill and spills with it). Smaller chunks
# are dominated by the step's fixed cost and would understate it.
PREFILL_RATE_MIN_TOKENS = 32


@dataclass
class _Launched:
    """A step whose tokens may still be on their way to the host."""

    seqs: list[Sequence]
    sampled: list[tuple[Sequence, int]]  # (sequence, index of its placeholder in its token ids)
    tokens: torch.Tensor  # on the device
    host: torch.Tensor  # host copy (complete once `event` has fired)
    event: object  # torch.cuda.Event, or None on CPU
    logits: torch.Tensor
    t0: float
    logprobs: sampler.StepLogprobs | None = None
    prompt_rows: list = ()  # prefill chunks' prompt logprobs: (seq, position, offset) into prompt_logits
    prompt_logits: torch.Tensor | None = None
    prefill_tokens: int = 0  # prompt tokens this step computes (beyond one per decode row)


@dataclass
class EngineStats:
    """Counters since start-up (bench/speculative.py reads tau from them)."""

    steps: int = 0  # target forwards
    decode_rows: int = 0  # sum over steps of the sequences that decoded (speculating or not)
    decode_tokens: int = 0  # tokens those rows emitted (accepted drafts + bonus), before stop cuts
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # draft tokens kept

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens per decoding sequence per target forward."""
        return self.decode_tokens / max(1, self.decode_rows)


class LLMEngine:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, weights: dict | None = None, *, ops=None,
                 model: torch.nn.Module | None = None, tp: TensorParallel | None = None, features=None,
                 workers=(), tokenizer=None):
        """Build from a model config and Hugging Face-named weights (None: random init).

        `model` replaces the Llama model with any object of the same interface
        (bench/engine.py passes one whose forward costs nothing). With `tp`, this is
        rank 0: it schedules, and its Runner broadcasts each step's plan to the ranks
        in `workers` (processes, joined by close()). `features` is an aux-feature hook
        for plain decoding: `.aux_layers`, `.keep_hidden` and `.feed(batch, StepOutput)`
        after every step (speculative.train records self-distillation data with it).
        `tokenizer` (or a callable loading it) serves structured output (replica.engine.grammar).
        """
        self.cfg, self.model_cfg, self.workers = cfg, model_cfg, list(workers)
        self.runner = Runner(cfg, model_cfg, weights, model=model, ops=ops, tp=tp)
        self.speculator = None
        kind = cfg.speculative
        if kind == "auto":
            from replica.engine.speculation import auto_kind

            kind = auto_kind(cfg, model_cfg) if self.runner.tp.world == 1 else "off"
            cfg = self.cfg = replace(cfg, speculative=kind)
        if kind != "off":
            from replica.engine.speculation import Speculator

            if features is not None:
                raise ValueError("a feature hook records plain decoding: build the engine with speculative='off'")
            # The head (if any) is the feature hook: it sees every token the target computes.
            self.speculator = features = Speculator(cfg, model_cfg, self.runner.head_embedding(),
                                                    self.runner.ops)
        self.features = features
        layout = self.runner.allocate_kv(aux_layers=features.aux_layers if features is not None else (),
                                         keep_hidden=features is not None and features.keep_hidden,
                                         draft_kv=self.speculator.kv_shape if self.speculator is not None else None)
        if self.speculator is not None and self.speculator.kv_shape is not None:
            self.speculator.bind_kv(self.runner.draft_kv, self.runner.model.cos_sin, self.runner.graphs)
            self.runner.capture_verify(self.speculator.verify_nodes())  # CUDA graphs of the pure verify steps
        # int8 prefill or decode rows need a calibration (kept beside the built model, else run on text
        # now); "auto" with nothing to calibrate on keeps every row int16
        prompts_from, decodes = cfg.int8_prompts_from(), cfg.decode_activations == "int8"
        if prompts_from is not None or decodes:
            for name in ("prefill_activations", "decode_activations"):
                if tokenizer is None and getattr(cfg, name) == "int8":
                    raise ValueError(f"{name}='int8' calibrates on text at start: give the engine its tokenizer")
            self.runner.enable_narrow(prompts_from, lambda: calibration_prompts(tokenizer, model_cfg.vocab_size)
                                      if tokenizer is not None else [], decodes=decodes)
        self.max_model_len = self.runner.max_model_len
        self.blocks = BlockManager(layout.num_blocks, cfg.block_size)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len,
                                   speculation=self.speculator, prefill_only_tokens=cfg.prefill_only_tokens)
        # Overlap: with TP every rank samples each step itself, so the next step's
        # placeholders resolve on every rank's device. With speculation it covers the
        # plain steps; a verify step drains the pipeline first (drafting needs the
        # tokens, and how many a verify emits is known only once read back).
        self.overlap = cfg.overlap if cfg.overlap is not None else self.runner.device.type == "cuda"
        self._inflight: _Launched | None = None
        self.seqs: dict[str, Sequence] = {}
        self.new_chains: set[str] = set()  # requests that start a conversation, not yet a chain cached (`chains`)
        self.forks = Forks()  # n > 1: samples waiting for their leader's prompt prefill
        self.grammars = Grammars(tokenizer, model_cfg.vocab_size, self.runner.device)  # constrained: wait to compile
        self.eos_ids = frozenset(model_cfg.eos_token_ids)
        self._rng = random.Random(cfg.seed)
        self.step_ms = 0.0  # exponential moving average
        self.step_counts = [0] * (len(P.STEP_BUCKETS_S) + 1)  # steps by time (Load.step_counts), and their seconds
        self.step_seconds = 0.0
        self.prefill_tokens_per_s = 0.0  # measured on steps with PREFILL_RATE_MIN_TOKENS or more (moving average)
        self.stats = EngineStats()

    # -- requests ---------------------------------------------------------------------
    def validate(self, req: P.Generate) -> tuple[str, str] | None:
        """(error code, message naming the problem), or None when the request is valid."""
        if req.id in self.seqs:
            return P.BAD_REQUEST, f"request id {req.id!r} is already in flight"
        V = self.model_cfg.vocab_size
        problem = check_generate(req, self.max_model_len) or check_for_model(req, V, self.max_model_len)
        if problem is not None:
            return problem
        if req.sampling.n != 1:
            return P.BAD_REQUEST, "n must be 1 at the engine (the API process sends each sample on its own)"
        if self.speculator is not None and req.sampling.prompt_logprobs is not None:
            return P.BAD_REQUEST, "prompt_logprobs (echo with logprobs) need a replica without speculative decoding"
        if self.runner.tp.world > 1 and self.overlap and (req.sampling.processed() or req.sampling.grammar):
            return P.BAD_REQUEST, ("penalties, logit_bias, min_p, min_tokens and grammars need overlap scheduling off with "
                                   "tensor parallelism (every rank samples on its own)")
        return None

    def add(self, req: P.Generate) -> P.Error | None:
        """Queue a request, or return the Error that rejects it."""
        problem = self.validate(req)
        if problem is not None:
            return P.Error(code=problem[0], message=problem[1], id=req.id)
        sp = req.sampling
        seed = sp.seed if sp.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(req.id, req.prompt_ids, sp, seed=seed, eos_ids=self.eos_ids, priority=req.priority,
                       cache_salt=req.cache_salt, resume_ids=req.resume_ids)
        self.seqs[req.id] = seq
        if req.new_chain:
            self.new_chains.add(req.id)
        if sp.grammar:
            self.grammars.hold(seq, req.fork_of)  # queued once compiled (`_compiled`)
        else:
            self._queue(seq, req.fork_of)
        return None

    def _queue(self, seq: Sequence, fork_of: str) -> None:
        leader = self.seqs.get(fork_of) if fork_of else None
        if leader is not None and not leader.first_token_time:
            self.forks.park(leader.id, seq)  # waits for the leader's prompt KV (replica.engine.forks)
        else:
            self.scheduler.add(seq)

    def _compiled(self) -> list:
        """Queue the held sequences whose grammar is ready; Error / Finished for the others."""
        out = []
        for seq, fork_of, err in self.grammars.ready():
            if seq.status == Status.FINISHED:
                continue
            if err or seq.grammar.is_stopped():  # a bad grammar, or resumed with it already complete
                self.seqs.pop(seq.id)
                seq.status = Status.FINISHED
                self._release_forks(seq)
                out.append(P.Error(code=P.BAD_REQUEST, message=err, id=seq.id) if err
                           else self._finished(seq, P.FINISH_STOP))
            else:
                self._queue(seq, fork_of)
        return out

    def abort(self, req_id: str) -> P.Finished | None:
        seq = self.seqs.pop(req_id, None)
        if seq is None:
            return None
        if self.forks.discard(seq) or self.grammars.discard(seq):
            seq.status = Status.FINISHED
        else:
            self.scheduler.remove(seq)
            self._release_forks(seq)
        return self._finished(seq, P.FINISH_ABORT)

    def _release_forks(self, seq: Sequence) -> None:
        for s in reversed(self.forks.release(seq.id)):
            self.scheduler.add(s, front=True)

    def drop_inflight(self) -> list[Sequence]:
        """Forget the step in flight without reading it back (crash containment resets its
        sequences); returns them."""
        step, self._inflight = self._inflight, None
        return step.seqs if step is not None else []

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None or bool(self.grammars.waiting)

    # -- the step ---------------------------------------------------------------------
    def step(self, return_logits: bool = False):
        """Run one batch; return Tokens / Finished messages for the API process
        (and, for tests, {request id: fp32 logits of the sampled position}).

        With overlap (CUDA by default), step N+1 is scheduled and launched before
        step N's tokens are read back, so the host's work hides under the GPU's;
        the messages returned are step N's."""
        early = self._compiled() if self.grammars.waiting else []
        if self.overlap:
            out = early + self._step_overlap()
            return (out, {}) if return_logits else out
        batch = self.scheduler.schedule()
        if batch.spec is not None:
            out = early + self._step_speculative(batch)
            return (out, {}) if return_logits else out
        launched = self._launch(batch)
        out = early + (self._resolve(launched) if launched is not None else [])
        if return_logits:
            return out, {seq.id: launched.logits[i].clone() for i, (seq, _) in enumerate(launched.sampled)} if launched else {}
        return out

    def _step_overlap(self) -> list:
        out = []
        if self._inflight is not None and self.scheduler.speculates_next():
            out, self._inflight = self._resolve(self._inflight), None  # drafting needs real tokens
        batch = self.scheduler.schedule()
        if batch.spec is not None:  # nothing in flight: see above
            return out + self._step_speculative(batch)

        def drain() -> None:  # a constrained row's mask needs its in-flight token: read it back now
            nonlocal out
            out, self._inflight = self._resolve(self._inflight), None

        # Sequences with unread tokens hold placeholders: the plan refers to the
        # in-flight step's token tensor, resolved on the device.
        launched = self._launch(batch, self._inflight, drain if self._inflight is not None else None)
        if self._inflight is not None:
            out = self._resolve(self._inflight)
        self._inflight = launched
        return out

    def _launch(self, batch, prev: _Launched | None = None, drain=None) -> _Launched | None:
        """Plan, run and sample a batch without reading the tokens back; account the
        tokens as computed and append one placeholder per sampled sequence. Grammar
        masks are computed while the forward runs; `drain()` reads the previous
        step back first when a constrained row's newest token is still in flight."""
        if not batch.seqs:
            return None
        t0 = time.perf_counter()
        plan = plan_step(batch)
        prompt_rows = sampler.prompt_rows(plan, batch)
        seqs = [batch.seqs[i] for i in plan.sample_rows]
        masks = self.grammars.begin(self.grammars.rows(seqs))
        out = self.runner.execute(plan, prev.tokens if prev is not None else None, seqs,
                                  self.grammars.constrain(masks, drain))
        if self.features is not None:  # the head (or a recorder) sees every token computed
            self.features.feed(batch, out)
        host, event = self.runner.to_host(out.tokens)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed += n
        sampled = []
        for j, i in enumerate(plan.sample_rows):
            seq = batch.seqs[i]
            sampled.append((seq, len(seq.token_ids)))
            seq.token_ids.append(placeholder(j))  # this step's j-th token, until `_resolve` reads it back
            seq.num_unresolved += 1
        self.stats.decode_rows += batch.num_decodes
        self.stats.decode_tokens += batch.num_decodes
        return _Launched(batch.seqs, sampled, out.tokens, host, event, out.logits, t0, out.logprobs, prompt_rows,
                         out.prompt_logits, sum(batch.num_tokens) - batch.num_decodes)

    def _resolve(self, step: _Launched) -> list:
        """Read a launched step's tokens back, replace its placeholders, check stops."""
        if step.event is not None:
            step.event.synchronize()
        tokens = step.host.tolist()
        sampler.keep_logprobs([seq for seq, _ in step.sampled], step.logprobs)
        sampler.collect_prompt_logprobs(step.prompt_rows, step.prompt_logits)
        now = time.monotonic()
        out = [self._emit(seq, [tok], now, at=pos) for (seq, pos), tok in zip(step.sampled, tokens)]
        self._settle(step.seqs, [seq for seq, _ in step.sampled], step.t0, step.prefill_tokens)
        return [m for m in out if m is not None]

    def _settle(self, seqs: list[Sequence], sampled: list[Sequence], t0: float, prefill_tokens: int = 0) -> None:
        """After a step's tokens are emitted: hash the blocks its live sequences computed
        (their tokens before num_computed are all real and verified now), start the samples
        waiting for a sampled sequence's prompt (cached now), count the step."""
        for seq in seqs:
            if seq.status != Status.FINISHED:
                self.blocks.commit(seq)
        for seq in sampled:
            self._release_forks(seq)
        self._count_step(t0, prefill_tokens)

    def _count_step(self, t0: float, prefill_tokens: int = 0) -> None:
        self.stats.steps += 1
        dt = (time.perf_counter() - t0) * 1e3
        self.step_ms = dt if self.stats.steps == 1 else 0.9 * self.step_ms + 0.1 * dt
        seconds = dt / 1e3
        self.step_counts[bisect.bisect_left(P.STEP_BUCKETS_S, seconds)] += 1  # a bound's bucket holds steps <= it
        self.step_seconds += seconds
        if prefill_tokens >= PREFILL_RATE_MIN_TOKENS:  # a step that was mostly prefill: its rate is the prefill rate
            rate = prefill_tokens / dt * 1e3
            self.prefill_tokens_per_s = rate if not self.prefill_tokens_per_s else (
                0.8 * self.prefill_tokens_per_s + 0.2 * rate)

    def _step_speculative(self, batch) -> list:
        """Draft, verify and append: rows [0, batch.num_spec) may emit several tokens."""
        t0 = time.perf_counter()
        drafts = self.speculator.draft(batch)  # a list of host trees, or the head's Drafts on the device
        if not isinstance(drafts, list) and (self.runner.tp.world > 1 or any(
                s.grammar is not None for s in batch.seqs[: batch.num_spec])):
            drafts = drafts.trees()  # the host's: a broadcast plan, grammar masks (a second read)
        on_device = not isinstance(drafts, list)
        if on_device:  # the step reads the host once (Speculator.accept)
            trees, plan = drafts, plan_step(batch, drafts=drafts)
        else:
            # A constrained sequence's drafts are cut to what its grammar accepts, and every
            # node is verified against the mask of its state (replica.engine.grammar).
            trees = [self.grammars.prune(s, t) for s, t in zip(batch.seqs, drafts)]
            plan = plan_step(batch, trees)
        num_trees = len(plan.trees) + plan.draft_rows
        seqs = [batch.seqs[i] for i in plan.sample_rows]
        masks = self.grammars.begin(self.grammars.tree_rows([] if on_device else trees, batch.seqs)
                                    + self.grammars.rows(seqs, first_row=sum(plan.num_tokens[:num_trees])))
        out = self.runner.execute(plan, seqs=seqs, constrain=self.grammars.constrain(masks),
                                  drafts=trees if on_device else None)
        sampler.keep_logprobs([batch.seqs[i] for i in plan.sample_rows], out.logprobs)  # plain rows only
        results, src, dst = self.speculator.accept(batch, trees, plan, out)
        self.runner.move_kv(src, dst)
        msgs: list = []
        now = time.monotonic()
        for i, (seq, n, (tokens, accepted)) in enumerate(zip(batch.seqs, batch.num_tokens, results)):
            seq.num_computed += n  # a speculating row: its root (the accepted drafts follow in `_emit`)
            if tokens:  # else a prefill chunk short of the prompt's end
                msgs.append(self._emit(seq, tokens, now, drafts=accepted if i < batch.num_spec else None))
        self._settle(batch.seqs, [seq for seq, (tokens, _) in zip(batch.seqs, results) if tokens], t0)
        st = self.stats
        st.decode_rows += batch.num_decodes
        st.decode_tokens += batch.num_decodes - num_trees + sum(len(r[0]) for r in results[:num_trees])
        st.drafted += sum(plan.num_tokens[:num_trees]) - num_trees
        st.accepted += sum(r[1] for r in results[:num_trees])
        return msgs

    def _emit(self, seq: Sequence, tokens: list[int], now: float, *, at: int | None = None,
              drafts: int | None = None) -> P.Tokens | P.Finished | None:
        """Make one step's `tokens` seq's and say so: the one emit path of every kind of step.

        Each token is checked for a stop (`_accept`: EOS, stop ids, max_tokens, the model's
        length, a complete grammar) as it is added; the first stop cuts the rest (a
        speculating row's accepted run) and finishes the request, once. Returns the
        Tokens message, the Finished one, or None when seq finished (or was aborted)
        while its step was in flight. `now` is the step's first-token time.

        at: the index of the placeholder the one token replaces (a launched step read
        back, `_resolve`); otherwise the tokens are appended. drafts: a speculating row's
        accepted draft tokens among `tokens`: verified, with their KV in place, so all but
        the newest emitted token are computed, and the blocks past it go back."""
        if at is not None:
            (tok,) = tokens
            seq.token_ids[at] = tok
            seq.num_unresolved -= 1
            if seq.status == Status.FINISHED:
                return None  # finished or aborted while its step was in flight
        first = not seq.first_token_time
        if first:
            seq.first_token_time = now
        emitted, reason = [], ""
        for tok in tokens:
            if at is None:
                seq.token_ids.append(tok)
            emitted.append(tok)
            length = at + len(emitted) if at is not None else len(seq)  # this token's number in seq
            reason = self._accept(seq, tok, length)
            if reason:
                break
        if drafts is not None:  # before `_finish`: its commit hashes the computed (verified) tokens
            seq.num_computed = len(seq) - 1
            seq.num_accepted_drafts += min(drafts, len(emitted))
        if reason:
            return self._finish(seq, reason, emitted, length=length)
        if drafts is not None:
            self.blocks.truncate(seq, len(seq))  # rejected drafts' blocks go back
        return sampler.attach(self._tokens(seq, emitted, first), seq)

    def _accept(self, seq: Sequence, tok: int, length: int) -> str:
        """The finish reason once `tok` (token number `length`) is seq's, or "": stop
        conditions, and for a constrained sequence its grammar (complete: "stop")."""
        reason = seq.check_stop(tok, length, self.max_model_len)
        if seq.grammar is not None:
            return self.grammars.accept(seq, tok) or reason
        return reason

    @staticmethod
    def _tokens(seq: Sequence, ids: list[int], first: bool) -> P.Tokens:
        """A Tokens message; the first of a request says how much of its prompt the cache served."""
        return P.Tokens(id=seq.id, ids=ids, cached_tokens=max(0, seq.num_cached_prompt) if first else 0)

    def _finished(self, seq: Sequence, reason: str, last_ids: list[int] = (), length: int = 0) -> P.Finished:
        ttft = (seq.first_token_time - seq.arrival) * 1e3 if seq.first_token_time else 0.0
        length = length or len(seq.token_ids) - seq.num_unresolved
        usage = P.Usage(prompt_tokens=seq.num_prompt_tokens, completion_tokens=length - seq.num_prompt_tokens,
                        cached_tokens=max(0, seq.num_cached_prompt),
                        accepted_draft_tokens=seq.num_accepted_drafts)
        return sampler.attach(P.Finished(id=seq.id, finish_reason=reason, usage=usage, ttft_ms=ttft,
                                          ids=list(last_ids)), seq)

    def _finish(self, seq: Sequence, reason: str, last_ids: list[int], length: int) -> P.Finished:
        self.seqs.pop(seq.id)
        self.blocks.commit(seq)
        self.scheduler.remove(seq)
        self._release_forks(seq)
        return self._finished(seq, reason, last_ids, length)

    def close(self) -> None:
        """Release the tensor-parallel ranks and wait for their processes."""
        self.grammars.close()
        self.runner.close()
        for w in self.workers:
            w.wait(timeout=60)

    # -- reports ----------------------------------------------------------------------
    def load(self) -> P.Load:
        s = self.scheduler
        cpu_steps, cpu_solo_steps = self.runner.pool_stats()
        return P.Load(running=len(s.running), waiting=s.num_waiting, free_blocks=self.blocks.num_free,
                      total_blocks=self.blocks.num_blocks, step_ms=round(self.step_ms, 3),
                      waiting_tokens=s.waiting_tokens(), tokens_per_s=round(self.prefill_tokens_per_s, 1),
                      max_running=self.cfg.max_num_seqs, cpu_steps=cpu_steps, cpu_solo_steps=cpu_solo_steps,
                      step_counts=list(self.step_counts), step_seconds=round(self.step_seconds, 6),
                      chains=self.chains())

    def chains(self) -> int:
        """Load.chains: the chains cached, and the new conversations not yet in them (no block of their
        own committed: waiting, or admitted and not through their first block)."""
        if self.new_chains:
            bs = self.blocks.block_size
            self.new_chains = {rid for rid in self.new_chains if (s := self.seqs.get(rid)) is not None
                               and (s.num_cached_prompt < 0 or len(s.block_hashes) * bs <= s.num_cached_prompt)}
        return self.blocks.tips.tips + len(self.new_chains)

    def kv_events(self) -> P.KvEvents | None:
        stored, removed = self.blocks.drain_events()
        if not stored and not removed:
            return None
        return P.KvEvents(stored=stored, removed=removed)
