"""Every Generate is checked again at the replica before anything acts on it.

The proxy validates first, but a replica also serves its own HTTP API and any
peer holding its secret, so a request is never trusted to be well formed:

  * `check_generate` (API process, before the detokenizer or the engine socket
    sees the request): sizes of every string and list, and every integer in range
    of the type it becomes (token ids and top_k are int32 on the device, seeds
    int64), floats finite, sampling parameters in range;
  * `check_for_model` (engine process): token ids inside the model's vocabulary,
    prompt + resumed tokens inside its context.

Each returns (error code, message naming the field) or None. Imports msgspec's
protocol only (no torch): the API process calls it.
"""

from __future__ import annotations

import math

from wire import protocol as P

MAX_ID_CHARS = 256  # request ids (the proxy's public ids are at most 128 characters)
MAX_SALT_CHARS = 256
MAX_TRACEPARENT_CHARS = 256
MAX_TOKEN_IDS = 1 << 20  # prompt or resume ids; the engine then checks its context length


def _ids_problem(name: str, ids: list[int], limit: int) -> str | None:
    if len(ids) > MAX_TOKEN_IDS:
        return f"{name} has {len(ids)} token ids; at most {MAX_TOKEN_IDS}"
    if any(not 0 <= t < limit for t in ids):
        return f"{name}: token ids must be in [0, {limit})"
    return None


def check_generate(req: P.Generate, max_tokens_limit: int) -> tuple[str, str] | None:
    """Shape and ranges of a request, independent of the model."""
    if not req.id or len(req.id) > MAX_ID_CHARS:
        return P.BAD_REQUEST, f"request ids are 1..{MAX_ID_CHARS} characters"
    if not req.prompt_ids:
        return P.BAD_REQUEST, "prompt is empty"
    for name, ids in (("prompt_ids", req.prompt_ids), ("resume_ids", req.resume_ids)):
        problem = _ids_problem(name, ids, P.INT32_MAX + 1)
        if problem:
            return P.BAD_REQUEST, problem
    if req.priority not in (P.INTERACTIVE, P.BATCH):
        return P.BAD_REQUEST, f"priority must be {P.INTERACTIVE} (interactive) or {P.BATCH} (batch)"
    if not (math.isfinite(req.deadline_ms) and req.deadline_ms >= 0):
        return P.BAD_REQUEST, f"deadline_ms must be a finite number >= 0, got {req.deadline_ms}"
    if len(req.cache_salt) > MAX_SALT_CHARS:
        return P.BAD_REQUEST, f"cache_salt is at most {MAX_SALT_CHARS} characters"
    if len(req.traceparent) > MAX_TRACEPARENT_CHARS:
        return P.BAD_REQUEST, f"traceparent is at most {MAX_TRACEPARENT_CHARS} characters"
    problem = req.sampling.validate(max_tokens_limit)
    if problem:
        return P.BAD_REQUEST, problem
    if len(req.resume_ids) >= req.sampling.max_tokens:
        return P.BAD_REQUEST, "resume_ids already reach max_tokens"
    return _samples_problem(req)


def _samples_problem(req: P.Generate) -> tuple[str, str] | None:
    """n > 1 resumed: aligned, distinct sample indices below n, each resume list like resume_ids."""
    n, ids = req.sampling.n, req.sample_ids
    if len(req.fork_of) > MAX_ID_CHARS:
        return P.BAD_REQUEST, f"fork_of is at most {MAX_ID_CHARS} characters"
    if len(ids) != len(req.sample_resume) or len(set(ids)) != len(ids) or any(not 0 <= i < n for i in ids):
        return P.BAD_REQUEST, f"sample_ids and sample_resume must be aligned, distinct sample indices in [0, {n})"
    for resume in req.sample_resume:
        problem = _ids_problem("sample_resume", resume, P.INT32_MAX + 1)
        if problem:
            return P.BAD_REQUEST, problem
        if len(resume) >= req.sampling.max_tokens:
            return P.BAD_REQUEST, "sample_resume already reaches max_tokens"
    return None


def check_for_model(req: P.Generate, vocab_size: int, max_model_len: int) -> tuple[str, str] | None:
    """What only the engine knows: the vocabulary and the context length."""
    n = len(req.prompt_ids) + len(req.resume_ids)
    if n >= max_model_len:
        return P.PROMPT_TOO_LONG, (f"prompt has {n} tokens but this replica's context is {max_model_len} tokens, "
                                   "output included")
    for name, ids in (("prompt_ids", req.prompt_ids), ("resume_ids", req.resume_ids)):
        problem = _ids_problem(name, ids, vocab_size)
        if problem:
            return P.BAD_REQUEST, problem
    problem = req.sampling.validate(max_model_len, vocab_size)  # token ids inside it, now against the vocabulary
    return (P.BAD_REQUEST, problem) if problem else None
