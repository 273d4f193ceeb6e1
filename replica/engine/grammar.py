"""Structured output in the engine: a grammar matcher per constrained sequence and
each step's token masks, with llguidance (see wire/structured.py for the choice).

A request is constrained when `SamplingParams.grammar` holds an llguidance grammar
(the front door builds it from `response_format`, vLLM's `guided_*`, or a tool
choice). Its life here:

  * add: the grammar is compiled (an `LLMatcher` over the model's tokenizer) in the
    compile thread, once per distinct grammar text (an LRU of compiled matchers;
    a request gets a `deep_copy`, which shares the compiled lexer and parser
    tables). The sequence waits outside the scheduler until its matcher is ready,
    so a slow compile never stalls other streams' steps. Tokens it already has
    (`resume_ids`: failover) are fed to its matcher first: the grammar state is a
    function of the tokens so far, wherever they were generated.
  * each step: the masks of the constrained logits rows are computed in the mask
    thread while the forward runs (both release the GIL), as one packed bitmask
    (R, V/32) int32; it is copied to the device and applied there -- disallowed
    tokens' logits set to -inf -- after the sampling params' processing, before the
    sampler; the logprobs stay the model's raw ones. A row whose newest token is
    still on the device (overlap) has its mask computed once the engine has read
    that token back, still while this step's forward runs on the device.
  * speculation: a constrained sequence's draft tree is cut to the nodes whose path
    the grammar accepts (`prune`: a refused draft is never verified), and every
    node left gets the mask of the state after its path, so the target's token
    after each node -- argmax, seeded draw or rejection sampling against the masked
    distribution -- is the one plain constrained decoding would emit there.
  * each token: consumed by the matcher when the host sees it; a grammar that can
    take no further token finishes the request ("stop") without waiting for EOS.
  * preemption: the tokens stay with the sequence, so the matcher stays as it is.

Invariant: a sequence's matcher has consumed exactly its resolved generated tokens
(token_ids[num_prompt_tokens:] minus in-flight placeholders).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

log = logging.getLogger("replica.engine.grammar")

CACHE_SIZE = 64  # compiled grammars kept (each a few hundred KiB at most)


class GrammarError(ValueError):
    """A grammar the engine cannot use (invalid, or no tokenizer for this model)."""


def lark_tokenizer(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The llguidance view of a `replica.tokenizer.Tokenizer`: the same tokenizers JSON
    (vocabulary, merges, byte-level decoding), EOS ids, and the model's logits width
    (ids past the tokenizer's vocabulary are never allowed)."""
    if tokenizer.vocab_size > vocab_size:
        raise GrammarError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {vocab_size} "
                           "logits: structured output needs the model's own tokenizer")
    return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                  eos_token=list(tokenizer.eos_token_ids))


@dataclass
class StepMask:
    """The masks of one step's constrained logits rows, being computed (or to compute at `apply`)."""

    rows: list[int]  # logits rows, in the plan's order (tree nodes, then sample rows)
    jobs: list[tuple[object, list[int]]]  # per row: the matcher, and the draft tokens its state is after (a path)
    bitmask: torch.Tensor  # (len(rows), words) int32, on the host
    future: Future | None  # None: not started (a row's newest token was still in flight)


class Grammars:
    def __init__(self, tokenizer, vocab_size: int, device: torch.device, cache_size: int = CACHE_SIZE):
        """tokenizer: a replica.tokenizer.Tokenizer, a callable returning one (loaded in
        the compile thread when the first grammar arrives), or None (no structured output)."""
        self.vocab_size, self.device, self.cache_size = vocab_size, torch.device(device), cache_size
        self.words = (vocab_size + 31) // 32
        self._tokenizer_src = tokenizer
        self._lltok: llguidance.LLTokenizer | None = None
        self._compile_pool: ThreadPoolExecutor | None = None
        self._mask_pool: ThreadPoolExecutor | None = None
        self._cache: OrderedDict[str, Future] = OrderedDict()  # grammar text -> Future[LLMatcher] (a template)
        self.waiting: list[tuple[object, str, Future]] = []  # (sequence, fork_of, compile future)
        self._bits = torch.arange(32, dtype=torch.int32, device=self.device)

    # -- compiling ------------------------------------------------------------------
    def _tokenizer(self) -> llguidance.LLTokenizer:
        """(compile thread) The llguidance tokenizer, built on first use."""
        if self._lltok is None:
            src = self._tokenizer_src
            if src is None:
                raise GrammarError("structured output needs the model's tokenizer, and this engine has none")
            try:
                tok = src() if callable(src) else src
            except (OSError, ValueError) as e:
                raise GrammarError(f"structured output needs the model's tokenizer, which did not load: {e}") from e
            self._lltok = lark_tokenizer(tok, self.vocab_size)
        return self._lltok

    def _compile(self, grammar: str):
        """(compile thread) A matcher at the grammar's start, its first mask computed (warm)."""
        m = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"grammar: {m.get_error()}")
        m.compute_bitmask()
        if m.is_error():
            raise GrammarError(f"grammar: {m.get_error()}")
        return m

    def compile(self, grammar: str) -> Future:
        """Future[LLMatcher]: the compiled grammar (shared: deep_copy it), cached by text."""
        fut = self._cache.get(grammar)
        if fut is not None:
            self._cache.move_to_end(grammar)
            return fut
        if self._compile_pool is None:
            self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        fut = self._cache[grammar] = self._compile_pool.submit(self._compile, grammar)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return fut

    def warm(self) -> None:
        """Build the tokenizer's tables in the compile thread now, not at the first
        constrained request (a few hundred ms for a 49k vocabulary)."""
        self.compile('{"grammars": [{"lark_grammar": "start: \\"a\\""}]}')

    def hold(self, seq, fork_of: str = "") -> None:
        """Keep `seq` out of the scheduler until its grammar is compiled (see `ready`)."""
        self.waiting.append((seq, fork_of, self.compile(seq.sampling.grammar)))

    def discard(self, seq) -> bool:
        """Forget a held sequence (aborted while compiling); False if it was not held."""
        n = len(self.waiting)
        self.waiting = [w for w in self.waiting if w[0] is not seq]
        return len(self.waiting) != n

    def ready(self) -> list[tuple[object, str, str]]:
        """Held sequences whose grammar is compiled: (sequence, fork_of, error message or "").
        Without an error the sequence has its matcher, advanced over the tokens it has."""
        if not self.waiting or not any(f.done() for _, _, f in self.waiting):
            return []
        out, still = [], []
        for seq, fork_of, fut in self.waiting:
            if not fut.done():
                still.append((seq, fork_of, fut))
                continue
            err = fut.exception()
            if err is not None:
                if not isinstance(err, GrammarError):  # unexpected: logged, and not kept in the cache
                    log.error("grammar compile failed", exc_info=err)
                    self._cache.pop(seq.sampling.grammar, None)
                out.append((seq, fork_of, str(err)))
                continue
            m = fut.result().deep_copy()
            done = seq.token_ids[seq.num_prompt_tokens:]
            if done and m.try_consume_tokens(done) != len(done):
                out.append((seq, fork_of, "resume_ids do not follow the request's grammar"))
                continue
            seq.grammar = m
            out.append((seq, fork_of, ""))
        self.waiting = still
        return out

    # -- tokens -------------------------------------------------------------------------
    @staticmethod
    def accept(seq, token: int) -> str:
        """Feed a sampled token to seq's matcher: "" to go on, "stop" when the grammar is
        complete, "error" when the token breaks it (a mask was not applied: a bug)."""
        m = seq.grammar
        if not m.consume_token(token):
            log.error("request %s: token %d is outside its grammar: %s", seq.id, token, m.get_error())
            return "error"
        return "stop" if m.is_stopped() else ""

    # -- speculation ----------------------------------------------------------------------
    @staticmethod
    def prune(seq, tree):
        """seq's draft tree cut to the nodes whose path from the root the grammar accepts
        (the root is seq's newest token, already consumed)."""
        m = seq.grammar
        if m is None or len(tree) == 1:
            return tree
        keep, paths = [0], {0: []}
        for i in range(1, len(tree)):
            parent = tree.parents[i]
            if parent not in paths:
                continue
            path = paths[parent] + [tree.tokens[i]]
            if m.validate_tokens(path) == len(path):
                paths[i] = path
                keep.append(i)
        if len(keep) == len(tree):
            return tree
        index = {old: new for new, old in enumerate(keep)}
        return type(tree)([tree.tokens[i] for i in keep], [-1] + [index[tree.parents[i]] for i in keep[1:]],
                          q=None if tree.q is None else tree.q[keep])

    # -- masks --------------------------------------------------------------------------
    @staticmethod
    def rows(seqs, first_row: int = 0) -> list[tuple[int, object, list[int]]]:
        """(logits row, sequence, path) of the constrained among a step's sampled sequences."""
        return [(first_row + j, s, []) for j, s in enumerate(seqs)
                if s.grammar is not None and not s.grammar.is_stopped()]

    @staticmethod
    def tree_rows(trees, seqs) -> list[tuple[int, object, list[int]]]:
        """(logits row, sequence, path from the root) of every node of the constrained sequences' trees."""
        out, row = [], 0
        for tree, s in zip(trees, seqs):
            if s.grammar is not None and not s.grammar.is_stopped():
                paths = [[]]
                for i in range(1, len(tree)):
                    paths.append(paths[tree.parents[i]] + [tree.tokens[i]])
                out.extend((row + i, s, p) for i, p in enumerate(paths))
            row += len(tree)
        return out

    def begin(self, rows: list[tuple[int, object, list[int]]]) -> StepMask | None:
        """Start computing the masks of these logits rows (in the mask thread), or None
        when there are none."""
        if not rows:
            return None
        bitmask = torch.empty((len(rows), self.words), dtype=torch.int32, pin_memory=self.device.type == "cuda")
        mask = StepMask([r for r, _, _ in rows], [(s.grammar, p) for _, s, p in rows], bitmask, None)
        if not any(s.num_unresolved for _, s, _ in rows):
            if self._mask_pool is None:
                self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
            mask.future = self._mask_pool.submit(_fill, mask.jobs, bitmask)
        return mask

    def constrain(self, mask: StepMask | None, before=None):
        """The Runner's `constrain(x, first_row)`: mask the rows of x (row 0 being logits row
        `first_row`) that are constrained; `before()` runs first when the masks still wait
        for tokens in flight (overlap: the engine reads the previous step back)."""
        if mask is None:
            return None

        def constrain(x: torch.Tensor, first_row: int) -> torch.Tensor:
            if mask.future is None and before is not None:
                before()
            return self.apply(x, mask, first_row)
        return constrain

    @torch.inference_mode()
    def apply(self, x: torch.Tensor, mask: StepMask, first_row: int = 0) -> torch.Tensor:
        """x (n, V) with its constrained rows' disallowed tokens at -inf (in place)."""
        if mask.future is None:
            mask.future = Future()
            _fill(mask.jobs, mask.bitmask)  # their tokens are on the host now
            mask.future.set_result(None)
        mask.future.result()
        sel = [k for k, r in enumerate(mask.rows) if first_row <= r < first_row + x.shape[0]]
        if not sel:
            return x
        host = mask.bitmask if len(sel) == len(mask.rows) else mask.bitmask[sel]
        bits = host.to(x.device, non_blocking=True)  # (R, words)
        R, V = bits.shape[0], x.shape[1]
        allowed = ((bits[:, :, None] >> self._bits) & 1).bool().view(R, -1)[:, :V]  # (R, words * 32) -> (R, V)
        rows = [mask.rows[k] - first_row for k in sel]
        if rows == list(range(x.shape[0])):
            return x.masked_fill_(~allowed, float("-inf"))
        idx = torch.tensor(rows, dtype=torch.int64).to(x.device, non_blocking=True)
        x[idx] = x[idx].masked_fill(~allowed, float("-inf"))
        return x

    def close(self) -> None:
        for pool in (self._compile_pool, self._mask_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


def _fill(jobs, bitmask: torch.Tensor) -> None:
    """(mask thread) Row i of `bitmask` = the tokens jobs[i]'s matcher allows after its path
    (bit t of word t // 32); the path is consumed, then rolled back. llguidance writes
    straight into the tensor's memory, without the GIL."""
    row_bytes = bitmask.shape[1] * 4
    base = bitmask.data_ptr()
    for i, (m, path) in enumerate(jobs):
        n = m.try_consume_tokens(path) if path else 0
        if n != len(path):  # prune() keeps valid paths only; the node cannot be accepted anyway
            log.error("draft path %s left its grammar after %d tokens", path, n)
        m.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
        if n:
            m.rollback(n)
