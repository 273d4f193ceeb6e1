"""The Runner's sampler (`Sampler`) and the engine's side of SamplingParams beyond
temperature/top-k/top-p: per-step logits processing and logprobs, for the rows
that ask for them.

Per sampled row, in this order (vLLM's, and what OpenAI documents):

    x = logits + logit_bias
    x = x / r where x > 0, x * r elsewhere, for tokens in prompt + output   (repetition_penalty r)
    x = x - frequency * count(t) - presence * [count(t) > 0], over output   (counts include resumed tokens)
    x[EOS, stop ids] = -inf while fewer than min_tokens were generated
    x[t] = -inf where p(t) < min_p * p_max, i.e. x_t / T < max(x) / T + log(min_p)

then the seeded sampler (kernels/sampling.py, through the op set the Runner chose)
applies top-k, top-p and temperature, per row as its `replica.model.plan.Sampling` says.
Every input is a function of (params, tokens so far), so a seeded stream is still a
pure function of (seed, position, tokens so far): a resumed request, which carries
its tokens, continues exactly. Rows without such params are not touched (no copy).

Logprobs are the model's raw log-softmax (before any processing), as vLLM returns
them by default: the sampled token's and the top k. With overlap scheduling the
token history may end in a placeholder for the token still on the device; it is
resolved there (as replica.model.graphs.resolve_placeholders does), never on the host.

Prompt logprobs (completions `echo` with `logprobs`): the logits of every prompt
position are computed in the prefill (`StepPlan.extra_logits`) and the logprob of
the next prompt token taken from them; a sequence asking for them never reuses
cached blocks (their logits were never computed) and collects each position once
(a preempted sequence recomputes its prompt but does not repeat them).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from wire import protocol as P
from replica.model.graphs import resolve_placeholders
from replica.model.plan import Sampling, StepPlan


@dataclass
class LogprobState:
    """A sequence's logprobs not yet sent, and its prompt logprobs."""

    pending: list[P.TokenLogprob] = field(default_factory=list)  # generated tokens, in order
    prompt: list[P.TokenLogprob] = field(default_factory=list)  # prompt tokens 1..len(prompt)
    prompt_sent: bool = False


def state(seq) -> LogprobState:
    if seq.logprob_state is None:
        seq.logprob_state = LogprobState()
    return seq.logprob_state


def _tensor(data, dtype, device):
    return torch.tensor(data, dtype=dtype).to(device, non_blocking=True)


# -- processing ---------------------------------------------------------------------------
@torch.inference_mode()
def process(logits: torch.Tensor, seqs, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """The logits to sample from (B, V): `logits` itself when no row is processed, else a copy."""
    rows = [i for i, s in enumerate(seqs) if s.sampling.processed()]
    if not rows:
        return logits
    dev = logits.device
    x = logits[_tensor(rows, torch.int64, dev)]  # (R, V), a copy
    sub = [seqs[i] for i in rows]
    if not any(s.num_unresolved for s in sub):
        prev_tokens = None  # every history is on the host

    bias_r, bias_t, bias_v = [], [], []
    for r, s in enumerate(sub):
        for t, b in s.sampling.logit_bias.items():
            bias_r.append(r)
            bias_t.append(t)
            bias_v.append(b)
    if bias_r:
        x.index_put_((_tensor(bias_r, torch.int64, dev), _tensor(bias_t, torch.int64, dev)),
                     _tensor(bias_v, torch.float32, dev), accumulate=True)

    rep = [r for r, s in enumerate(sub) if s.sampling.repetition_penalty != 1.0]
    if rep:  # tokens of prompt + output: x / r where x > 0, else x * r
        r_idx, t_idx, _, seen = _counts(x.shape, [(r, sub[r].token_ids) for r in rep], prev_tokens, dev)
        penalty = _tensor([s.sampling.repetition_penalty for s in sub], torch.float32, dev)[:, None]
        if seen is None:  # sparse: each (row, token) once
            v, pen = x[r_idx, t_idx], penalty[r_idx, 0]
            x[r_idx, t_idx] = torch.where(v > 0, v / pen, v * pen)
        else:
            x = torch.where(seen > 0, torch.where(x > 0, x / penalty, x * penalty), x)

    freq = [r for r, s in enumerate(sub) if s.sampling.frequency_penalty or s.sampling.presence_penalty]
    if freq:  # over the output (resumed tokens are output too): x - f * count - p * [count > 0]
        r_idx, t_idx, c, counts = _counts(x.shape, [(r, sub[r].token_ids[sub[r].num_prompt_tokens:]) for r in freq],
                                          prev_tokens, dev)
        fp = _tensor([[s.sampling.frequency_penalty, s.sampling.presence_penalty] for s in sub], torch.float32, dev)
        if counts is None:
            x.index_put_((r_idx, t_idx), -(fp[r_idx, 0] * c + fp[r_idx, 1]), accumulate=True)
        else:
            x = x - fp[:, :1] * counts - fp[:, 1:] * (counts > 0)

    mask_r, mask_t = [], []
    for r, s in enumerate(sub):
        if s.num_completion_tokens < s.sampling.min_tokens:
            for t in set(s.eos_ids) | set(s.sampling.stop_token_ids):
                mask_r.append(r)
                mask_t.append(t)
    if mask_r:
        x.index_put_((_tensor(mask_r, torch.int64, dev), _tensor(mask_t, torch.int64, dev)),
                     torch.tensor(float("-inf"), device=dev))

    mp = [r for r, s in enumerate(sub) if s.sampling.min_p > 0 and s.sampling.temperature > 0]
    if mp:  # greedy rows keep their argmax whatever min_p says
        # log(min_p) * T per row; -inf (min_p 0: keep all) for rows without it
        cut = _tensor([math.log(s.sampling.min_p) * s.sampling.temperature if r in mp else float("-inf")
                       for r, s in enumerate(sub)], torch.float32, dev)[:, None]
        x = torch.where(x < x.max(-1, keepdim=True).values + cut, float("-inf"), x)

    if len(rows) == len(seqs):
        return x
    out = logits.clone()
    out[_tensor(rows, torch.int64, dev)] = x
    return out


def _counts(shape, histories, prev_tokens, dev):
    """How often each token occurs in each listed row's history: sparse (rows, tokens,
    counts, None) counted on the host, or, when a history ends in a placeholder for a
    token still on the device (overlap), dense (None, None, None, (R, V) counts) built
    there (deduplicating on the device would wait for it)."""
    if prev_tokens is None:
        rows, toks, counts = [], [], []
        for r, ids in histories:
            for t, n in Counter(ids).items():
                rows.append(r)
                toks.append(t)
                counts.append(n)
        return (_tensor(rows, torch.int64, dev), _tensor(toks, torch.int64, dev),
                _tensor(counts, torch.float32, dev), None)
    flat_r, flat_t = [], []
    for r, ids in histories:
        flat_r.extend([r] * len(ids))
        flat_t.extend(ids)
    dense = torch.zeros(shape, dtype=torch.float32, device=dev)
    t = resolve_placeholders(_tensor(flat_t, torch.int64, dev), prev_tokens)
    dense.index_put_((_tensor(flat_r, torch.int64, dev), t), torch.ones_like(t, dtype=torch.float32), accumulate=True)
    return None, None, None, dense


# -- logprobs -----------------------------------------------------------------------------
@dataclass
class StepLogprobs:
    """Device tensors for the rows that asked for logprobs, read back with the tokens."""

    rows: list[int]  # row i of these tensors is sampled row rows[i]
    chosen: torch.Tensor  # (R,) logprob of the sampled token
    top_ids: torch.Tensor  # (R, kmax)
    top_values: torch.Tensor  # (R, kmax)
    ks: list[int]

    def records(self) -> dict[int, P.TokenLogprob]:
        """{sampled row: its record} (reads the tensors back: call once the step is resolved)."""
        chosen, ids, vals = self.chosen.tolist(), self.top_ids.tolist(), self.top_values.tolist()
        return {row: P.TokenLogprob(chosen[i], ids[i][:k], vals[i][:k])
                for i, (row, k) in enumerate(zip(self.rows, self.ks))}


@torch.inference_mode()
def logprobs(logits: torch.Tensor, tokens: torch.Tensor, seqs) -> StepLogprobs | None:
    """Raw logprobs of the sampled tokens (and the top k) for the rows whose params ask for them."""
    rows = [i for i, s in enumerate(seqs) if s.sampling.logprobs is not None]
    if not rows:
        return None
    idx = _tensor(rows, torch.int64, logits.device)
    ks = [seqs[i].sampling.logprobs for i in rows]
    lp = torch.log_softmax(logits[idx].float(), dim=-1)
    top = lp.topk(max(ks), dim=-1)
    return StepLogprobs(rows, lp.gather(1, tokens[idx][:, None])[:, 0], top.indices, top.values, ks)


# -- the sampler --------------------------------------------------------------------------
class Sampler:
    """One token per logits row of a step, on the device; built by the Runner with its op set."""

    def __init__(self, ops, device: torch.device):
        self.ops, self.device = ops, device

    def __call__(self, logits: torch.Tensor, plan: StepPlan, prev_tokens: torch.Tensor | None = None, seqs=None,
                 constrain=None, depths: torch.Tensor | None = None) -> tuple[torch.Tensor, StepLogprobs | None]:
        """The tokens of logits rows (R, V) and the sample rows' logprobs. Tree nodes are drawn
        plainly (speculating sequences are `Sequence.plain`; constrained nodes are masked in
        place, so the acceptance reads the masked logits). Sample rows go through `process`
        when their sequences `seqs` are known (rank 0), plainly on the other ranks.
        prev_tokens: the in-flight step's tokens (placeholders in the histories);
        constrain(x, first_row) (rank 0): grammar masks (replica.engine.grammar); logprobs stay raw.
        depths: device trees' (plan.draft_rows) node depths, added to their rows' positions."""
        nt = len(plan.sampling) - len(plan.sample_rows)
        if seqs is None:
            return self.draw(logits, plan.sampling), None
        if constrain is not None and nt:
            constrain(logits[:nt], 0)
        rows = logits[nt:]
        x = process(rows, seqs, prev_tokens)
        if constrain is not None:
            x = constrain(x.clone() if x is rows else x, nt)
        tokens = self.draw(x, plan.sampling[nt:])
        lp = logprobs(rows, tokens, seqs)
        if nt:
            tokens = torch.cat([self.draw(logits[:nt], plan.sampling[:nt], depths), tokens])
        return tokens, lp

    @torch.inference_mode()
    def draw(self, logits: torch.Tensor, params: list[Sampling], offsets: torch.Tensor | None = None) -> torch.Tensor:
        """One token per row as params[row] says; randomness depends on (seed, position) only.
        Greedy rows take a plain argmax; only rows that sample pay for filtering
        and hashed noise (which rows is known on the host: no device sync).
        offsets (R,), on the device: added to the rows' positions."""
        hot = [i for i, p in enumerate(params) if p.temperature > 0]
        tokens = logits.argmax(-1)
        if hot:
            ps = [params[i] for i in hot]
            dev = self.device
            every = len(hot) == len(params)
            idx = None if every else _tensor(hot, torch.int64, dev)
            sampled = self.ops.sample(
                logits if every else logits[idx],
                _tensor([p.temperature for p in ps], torch.float32, dev),
                _tensor([p.top_k for p in ps], torch.int32, dev),
                _tensor([p.top_p for p in ps], torch.float32, dev),
                _tensor([p.seed for p in ps], torch.int64, dev),
                self._positions(ps, offsets if every or offsets is None else offsets[idx]))
            if every:
                tokens = sampled
            else:
                tokens[idx] = sampled
        return tokens

    def _positions(self, ps: list[Sampling], offsets: torch.Tensor | None) -> torch.Tensor:
        pos = _tensor([p.position for p in ps], torch.int64, self.device)
        return pos if offsets is None else pos + offsets


def keep_logprobs(seqs, lp: StepLogprobs | None) -> None:
    """Host side: queue each sampled row's record on its sequence (sent with its token)."""
    if lp is not None:
        for row, rec in lp.records().items():
            state(seqs[row]).pending.append(rec)


# -- prompt logprobs ----------------------------------------------------------------------
def prompt_rows(plan, batch) -> list[tuple[object, int, int]]:
    """(sequence, first position, flat token index) per prefill chunk whose positions'
    logits give prompt logprobs not collected yet; sets plan.extra_logits."""
    out, flat, extra = [], 0, []
    for seq, start, n in zip(batch.seqs, plan.starts, plan.num_tokens):
        if seq.sampling.prompt_logprobs is not None:
            # position p's logits give the logprob of prompt token p + 1
            lo = max(start, len(state(seq).prompt))
            hi = min(start + n, seq.num_prompt_tokens - 1)
            if lo < hi:
                out.append((seq, lo, len(extra)))
                extra.extend(range(flat + lo - start, flat + hi - start))
        flat += n
    plan.extra_logits = extra
    return out


@torch.inference_mode()
def collect_prompt_logprobs(rows, extra: torch.Tensor) -> None:
    """Append each chunk's prompt logprobs to its sequence (host: reads back)."""
    if not rows:
        return
    lp = torch.log_softmax(extra.float(), dim=-1)
    bounds = [r[2] for r in rows] + [lp.shape[0]]
    for (seq, lo, at), end in zip(rows, bounds[1:]):
        nxt = torch.tensor(seq.token_ids[lo + 1 : lo + 1 + end - at], dtype=torch.int64, device=lp.device)
        part = lp[at:end]
        chosen = part.gather(1, nxt[:, None])[:, 0].tolist()
        k = seq.sampling.prompt_logprobs
        top = part.topk(k, dim=-1) if k else None
        ids, vals = (top.indices.tolist(), top.values.tolist()) if k else ([[]] * len(chosen), [[]] * len(chosen))
        state(seq).prompt.extend(P.TokenLogprob(c, i, v) for c, i, v in zip(chosen, ids, vals))


def attach(msg, seq):
    """Move the sequence's unsent logprobs onto its Tokens/Finished message."""
    st = seq.logprob_state
    if st is not None:
        if st.pending:
            msg.logprobs, st.pending = st.pending[: len(msg.ids)], st.pending[len(msg.ids):]
        if not st.prompt_sent and seq.sampling.prompt_logprobs is not None:
            msg.prompt_logprobs, st.prompt_sent = st.prompt, True
    return msg
