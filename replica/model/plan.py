"""One step as plain data: what the Runner computes, and what rank 0 broadcasts to
tensor-parallel ranks.

Row i of a plan computes num_tokens[i] tokens of one sequence whose first
starts[i] tokens are in the KV cache. Rows come in this order:

  * draft trees, rows [0, len(trees)): the row's tokens are a tree's nodes, root
    first (the sequence's newest token); node j sits at position starts[i] +
    depth(j), its KV at the slot of position starts[i] + j, and it attends to the
    cached prefix and to its ancestors (trees[i] holds the parents, -1 for the
    root). Every node gets logits: the target's next-token distribution after it;
  * decodes, one token each, up to row num_decodes;
  * extends: prefill chunks.

Logits rows, in order: every tree node, then the last token of each row in
sample_rows (then, for prompt logprobs, the tokens in extra_logits). sampling[r]
(a `Sampling`) says how logits row r is sampled; the randomness is a pure function
of (seed, position), so every rank draws the same token from the same logits.

Placeholders (overlap scheduling): a token sampled by the step in flight, not
read back by the host yet, stands in its sequence's token ids (and so in the next
plan's input_ids) as `placeholder(j)`, a negative id: that step's j-th sampled
token, tokens[j] of its output (a step left in flight has no draft trees). The
device resolves it from its own copy of those tokens
(replica.model.graphs.resolve_placeholders), the engine once it reads them back.
A verify plan's device drafts (`draft_rows`) stand in its input ids the same way, as
placeholders of the drafts' tokens (Runner.execute's `drafts`).
`is_placeholder` and `placeholder_index` take ints or integer tensors alike.
"""

from __future__ import annotations

import msgspec


def placeholder(j: int) -> int:
    """The id standing for the in-flight step's j-th sampled token."""
    return -(j + 1)


def is_placeholder(t):
    """Whether token id `t` (or each id of a tensor) is a placeholder."""
    return t < 0


def placeholder_index(t):
    """j for `placeholder(j)` (elementwise on a tensor; meaningless for real ids)."""
    return -t - 1


class Sampling(msgspec.Struct, array_like=True, gc=False):
    """How one logits row is sampled. Encoded as a 5-element array: a plan broadcast to
    tensor-parallel ranks carries one per logits row."""

    temperature: float  # 0: greedy (argmax)
    top_k: int  # 0: off
    top_p: float  # >= 1: off
    seed: int
    position: int  # of the sampled token in its sequence: (seed, position) drives the randomness


class StepPlan(msgspec.Struct, array_like=True):
    input_ids: list[int]  # all rows' tokens, flattened
    starts: list[int]
    num_tokens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # non-tree rows whose last token's logits are sampled
    num_decodes: int  # rows [0, num_decodes) compute one token each (tree rows excepted)
    sampling: list[Sampling] = []  # per logits row
    trees: list[list[int]] = []  # parents of the nodes of each tree row
    # rows [0, draft_rows): trees on the device instead (speculative.drafting.Drafts, handed to
    # Runner.execute): num_tokens[i] nodes each, their ids placeholders of the drafts' tokens, their
    # parents and depths never on the host (sampling positions: start + 1, the depth added there)
    draft_rows: int = 0
    extra_logits: list[int] = []  # flat token indices whose logits follow the sampled rows' (prompt logprobs)
    prompt_lens: list[int] = []  # per row: its sequence's prompt tokens (positions past them are generated)
    # (src, dst) KV slot pairs, flattened: the accepted drafts' moves of the speculative step before
    # (Runner.move_kv), which rank 0 made at once and ranks 1..N-1 make before this step's forward
    kv_moves: list[int] = []


def sampling_of(seq, position: int) -> Sampling:
    """How `seq`'s token at `position` is drawn."""
    sp = seq.sampling
    return Sampling(sp.temperature, sp.top_k, sp.top_p, seq.seed, position)


def plan_step(batch, trees=(), drafts=None) -> StepPlan:
    """The plan of a scheduled batch. trees[i] (a speculative.drafting.DraftTree) replaces
    row i's one decode token by a draft tree rooted at that token; so does row i of `drafts`
    (speculative.drafting.Drafts, on the device: its node j of row i is placeholder(i * n + j))."""
    ids, starts, tables, sample_rows, sampling = [], [], [], [], []
    num_tokens = list(batch.num_tokens)
    prompt_lens = [seq.num_prompt_tokens for seq in batch.seqs]
    nd, n = (len(drafts), drafts.nodes) if drafts is not None else (0, 0)
    for i, (seq, m) in enumerate(zip(batch.seqs, batch.num_tokens)):
        start = seq.num_computed
        starts.append(start)
        tables.append(seq.block_table)
        if i < nd:
            ids.extend(placeholder(i * n + j) for j in range(n))
            num_tokens[i] = n
            sampling.extend([sampling_of(seq, start + 1)] * n)
            continue
        if i < len(trees):
            tree = trees[i]
            ids.extend(tree.tokens)
            num_tokens[i] = len(tree)
            sampling.extend(sampling_of(seq, start + 1 + d) for d in tree.depths)
            continue
        ids.extend(seq.token_ids[start : start + m])
        if start + m == len(seq):
            sample_rows.append(i)
    sampling.extend(sampling_of(batch.seqs[i], len(batch.seqs[i])) for i in sample_rows)
    return StepPlan(input_ids=ids, starts=starts, num_tokens=num_tokens, block_tables=tables, sample_rows=sample_rows,
                    num_decodes=batch.num_decodes, sampling=sampling, trees=[list(t.parents) for t in trees],
                    prompt_lens=prompt_lens, draft_rows=nd)


def slot(table: list[int], position: int, block_size: int) -> int:
    """The KV pool slot of a sequence's token at `position`."""
    return table[position // block_size] * block_size + position % block_size
