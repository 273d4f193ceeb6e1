"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time

from wire.protocol import SamplingParams


class Status(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    """Token ids (prompt, then generated) plus where they stand in the KV cache.

    Invariant: the KV of token_ids[:num_computed] is in the blocks of block_table;
    a step computes token_ids[num_computed : num_computed + n] and, when that
    reaches the end of token_ids, samples the next token.
    """

    __slots__ = (
        "id", "token_ids", "num_prompt_tokens", "sampling", "priority", "cache_salt",
        "seed", "arrival", "status", "block_table", "block_hashes",
        "num_computed", "num_cached_prompt", "first_token_time",
        "eos_ids", "num_unresolved", "draft_state", "num_accepted_drafts", "logprob_state",
        "grammar",
    )

    def __init__(self, id: str, prompt_ids: list[int], sampling: SamplingParams, *,
                 seed: int, eos_ids: frozenset[int], priority: int = 0, cache_salt: str = "",
                 resume_ids: list[int] = ()):
        self.id = id
        self.token_ids = list(prompt_ids) + list(resume_ids)
        self.num_prompt_tokens = len(prompt_ids)  # resume ids count as completion tokens
        self.sampling = sampling
        self.priority = priority
        self.cache_salt = cache_salt
        self.seed = seed
        self.arrival = time.monotonic()
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of the full blocks registered so far
        self.num_computed = 0
        self.num_cached_prompt = -1  # prefix-cache hit tokens at first admission (-1: not yet)
        self.first_token_time = 0.0
        self.eos_ids = eos_ids if not sampling.ignore_eos else frozenset()
        self.num_unresolved = 0  # overlap scheduling: placeholder tokens not yet read back
        self.draft_state = None  # EAGLE-3: the head's view of this sequence (speculative.drafting.HeadState)
        self.num_accepted_drafts = 0  # draft tokens accepted and emitted (usage)
        self.logprob_state = None  # replica.model.sampler.LogprobState once logprobs are asked for
        self.grammar = None  # llguidance.LLMatcher over the generated tokens when constrained (replica.engine.grammar)

    @property
    def plain(self) -> bool:
        """Tokens drawn from the logits alone (a grammar's mask aside, which the speculative
        step applies to drafts too), one at a time: what speculative rows must be."""
        sp = self.sampling
        return not sp.processed() and sp.logprobs is None and sp.prompt_logprobs is None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_decode(self) -> bool:
        return self.num_computed == len(self.token_ids) - 1

    def check_stop(self, token: int, length: int, max_model_len: int) -> str:
        """Finish reason for `token`, the sequence's token number `length` (1-based),
        or "" to keep going."""
        if token in self.eos_ids or token in self.sampling.stop_token_ids:
            return "stop"
        if length - self.num_prompt_tokens >= self.sampling.max_tokens or length >= max_model_len:
            return "length"
        return ""
