"""The Runner: the one place that runs the target model.

It owns the model (built from Hugging Face-named weights; under tensor
parallelism this rank's shard), the op set chosen for the device, the KV pool
(sized here), the decode graphs and the sampler. Every forward is
`execute(plan)` over a `replica.model.plan.StepPlan`: prefill chunks, decodes (eager,
or replayed per batch-size bucket) and draft-tree verification, then sampling.
On CPU a quantized fp32 model is built as `replica.model.cpu_model.CpuModel`: every
forward is then one C++ call (graph_mode "auto"; "off" keeps op by op).

KV pool: one tensor, layers x {k, v} x blocks x block_size x Hkv x D, in the model's
dtype, except under the C++ CPU step: there in the kernel set's `cpu_step_kv` (fp16
by default, half the bytes a long context's decode reads; int8 on request, each
(token, kv head) row its D codes and a 4-byte scale, so D + 4: kernels/paged.py,
and a block copied or moved carries its scales); plus the EAGLE-3 head's
one layer (`draft_kv`, same blocks, the head's dtype) when a head drafts: the head
addresses its KV through the sequence's own block table.

Tensor parallel (nano-vllm's ModelRunner.loop): on rank 0 `execute` broadcasts
the plan first; ranks 1..N-1 run `loop()`, executing every plan they receive and
sampling the same tokens from the same all-gathered logits (so with overlap each
rank resolves the next plan's placeholders from its own copy). `allocate_kv` is
collective: each rank says how many blocks its memory holds, rank 0 takes the
smallest and broadcasts the layout, so a block id means the same on every rank.
Speculation runs on rank 0 alone (the head, its KV layer, drafting, acceptance): the
verify is a plan like any other, and the accepted drafts' KV moves ride in the next
plan (`StepPlan.kv_moves`), made by every rank before its forward.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import msgspec
import torch

import kernels
from kernels.paged import pool_row
from replica.model import sampler
from replica.config import EngineConfig, ModelConfig
from replica.model.graphs import DecodeGraphs, resolve_placeholders
from replica.model.kv_staging import KvStaging
from replica.model.spec_graphs import VerifyGraphs, ancestor_masks
from replica.model import built, cpu_model
from replica.model.loader import Weights, load_gguf_quantized, random_weights, resolve_model
from replica.model.llama import Context, LlamaModel
from replica.model.plan import StepPlan, slot
from replica.model.quant import quantize_model
from replica.model.tp import TensorParallel, local_config, shard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class KvLayout(msgspec.Struct, array_like=True):
    """The KV pool every rank allocates (rank 0 decides, see `Runner.allocate_kv`)."""

    num_blocks: int
    block_size: int


@dataclass
class StepOutput:
    logits: torch.Tensor  # (R, V) fp32, R logits rows: every tree node, then the sample rows' last tokens
    tokens: torch.Tensor  # (R,) the token sampled from each logits row (plan.sampling), on the device
    aux: torch.Tensor | None = None  # (T, 3h): residual streams after the aux layers, every token of the step
    hidden: torch.Tensor | None = None  # (T, h): final hidden states, every token (keep_hidden only)
    logprobs: sampler.StepLogprobs | None = None  # the sample rows that ask for them
    prompt_logits: torch.Tensor | None = None  # (len(plan.extra_logits), V): prompt logprobs' positions


def kernel_set(cfg: EngineConfig):
    """The kernel set an engine with `cfg` runs: its device's, the C++ step's KV pool in
    cfg.kv_cache_dtype, the fused decode kernels where cfg.fused_decode asks (kernels.ops builds
    the C++ kernels once per machine)."""
    return kernels.ops(torch.device(cfg.device).type, cpu_step_kv=kernels.CPU_STEP_KV[cfg.kv_cache_dtype],
                       fused_decode=cfg.fused_decode)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    row = pool_row(cfg.head_dim, dtype)  # elements a (token, kv head): D, or D + 4 in int8
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * row * dtype.itemsize


def kv_budget(cfg: EngineConfig, model_cfg: ModelConfig) -> int:
    """Bytes this rank may give the KV pool. On CUDA: what the weights left of the
    allowed fraction of the GPU, minus a reserve for activations, logits and the
    CUDA-graph pool."""
    if cfg.kv_memory_bytes:
        return cfg.kv_memory_bytes
    if not cfg.device.startswith("cuda"):
        return 1 << 30
    free, total = torch.cuda.mem_get_info(torch.device(cfg.device))
    act = 4 * cfg.max_num_batched_tokens * (model_cfg.hidden_size * 8 + model_cfg.intermediate_size * 3)
    logits = 4 * 2 * cfg.max_num_seqs * model_cfg.vocab_size
    reserve = act + logits + (512 << 20)  # graphs share one pool; 512 MiB covers its bookkeeping
    budget = free - (1 - cfg.gpu_memory_utilization) * total - reserve
    if budget <= 0:
        raise RuntimeError(f"no GPU memory left for the KV cache: {free / 2**30:.1f} GiB free of "
                           f"{total / 2**30:.1f} GiB; raise gpu_memory_utilization or use a smaller model")
    return int(budget)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """(n, n) bool: [i, j] = node j is node i or one of its ancestors (parents[i] < i)."""
    n = len(parents)
    m = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            m[i] = m[p]
        m[i, i] = True
    return m


def tree_depths(parents: list[int]) -> list[int]:
    depths = [0] * len(parents)
    for i, p in enumerate(parents[1:], 1):
        depths[i] = depths[p] + 1
    return depths


class Runner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, weights: dict | None = None, *,
                 model: torch.nn.Module | None = None, ops=None, tp: TensorParallel | None = None):
        """Build the model from Hugging Face-named weights (None: random init), or take
        `model`, any object with LlamaModel's interface (bench/engine.py passes one
        whose forward costs nothing). The KV pool comes with `allocate_kv`."""
        self.cfg, self.tp = cfg, tp or TensorParallel()
        self.model_cfg = local_config(model_cfg, self.tp.world) if self.tp.world > 1 else model_cfg  # this rank's
        self.device, self.dtype, self.block_size = torch.device(cfg.device), DTYPES[cfg.dtype], cfg.block_size
        self.ops = ops if ops is not None else kernel_set(cfg)
        self.sampler = sampler.Sampler(self.ops, self.device)
        mpe = model_cfg.max_position_embeddings
        self.max_model_len = min(cfg.max_model_len or mpe, mpe)  # cut to the pool's size by allocate_kv
        if model is None:
            if weights is None:
                weights = random_weights(model_cfg, seed=cfg.seed)
            if isinstance(weights, Weights):  # read as this rank's shard already
                assert (weights.rank, weights.world) == (self.tp.rank, self.tp.world), (weights.rank, weights.world)
            elif self.tp.world > 1:
                weights = shard(weights, self.tp.rank, self.tp.world)
            model = build_model(self.model_cfg, cfg, weights, self.ops, self.max_model_len, self.tp)
            del weights
        self.model = model
        # An EAGLE-3 head on rank 0 embeds with the whole vocabulary: the ranks gather the
        # embedding's shards once, together (every rank's config says eagle3 alike).
        self._whole_embedding = None
        if self.tp.world > 1 and cfg.speculative == "eagle3":
            whole = self.tp.gather_rows(self.model.embed_tokens.weight.detach())
            self._whole_embedding = whole if self.tp.rank == 0 else None
        self._kv_moves: list[int] = []  # rank 0 of a group: moves the other ranks make before the next step
        self.kv_cache: torch.Tensor | None = None
        self.draft_kv: torch.Tensor | None = None  # (2, blocks, block_size, Hkv', D'): the EAGLE-3 head's layer
        self._staging: KvStaging | None = None  # a KV transfer's pinned buffer on CUDA (made on the first)
        self.graphs: DecodeGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None  # pure verify steps (replica.model.spec_graphs)
        self.aux_layers: tuple[int, ...] = ()
        self.keep_hidden = False
        self.narrow_from: int | None = None  # prompts this long prefill narrow (int8) rows: `enable_narrow`
        self.narrow_decodes = False  # plain decode rows narrow too (EngineConfig.decode_activations "int8")
        self._encoder = msgspec.msgpack.Encoder()

    def head_embedding(self) -> torch.Tensor:
        """The target's embedding as an EAGLE-3 head shares it: every row (rank 0 of a group
        holds the gathered whole; one rank, the model's own)."""
        return self._whole_embedding if self._whole_embedding is not None else self.model.embed_tokens.weight

    def pool_stats(self) -> tuple[int, int]:
        """The C++ CPU step's thread pool: (steps, steps on the calling thread alone); (0, 0) for other steps."""
        if not isinstance(self.model, cpu_model.CpuModel):
            return 0, 0
        return tuple(self.model.decoder.pool_stats())

    # -- KV pool --------------------------------------------------------------------------
    def kv_dtype(self) -> torch.dtype:
        """The KV pool's dtype: the C++ CPU step's (ops.cpu_step_kv), else the model's."""
        return self.ops.cpu_step_kv if isinstance(self.model, cpu_model.CpuModel) else self.dtype

    def allocate_kv(self, aux_layers: tuple[int, ...] = (), draft_kv: tuple[int, int] | None = None,
                    keep_hidden: bool = False, kv_dtype: torch.dtype | None = None) -> KvLayout:
        """Size and allocate the KV pool (collective under tensor parallelism), then
        build the decode graphs. aux_layers: every forward also returns the residual
        streams after these layers (what an EAGLE-3 head reads); draft_kv: (Hkv, D)
        of the head's one layer, which shares the blocks; keep_hidden: every forward
        also returns its final hidden states (training data; decodes run eagerly);
        kv_dtype: the pool's dtype instead of `kv_dtype()` (an op-by-op reference
        reading the fp16 pool the C++ step keeps: the references read any dtype)."""
        cfg, bs = self.cfg, self.block_size
        kv_dtype = kv_dtype or self.kv_dtype()
        per_block = kv_bytes_per_block(self.model_cfg, bs, kv_dtype)
        if draft_kv is not None:
            per_block += 2 * bs * draft_kv[0] * draft_kv[1] * self.dtype.itemsize
        capacity = cfg.num_blocks or max(1, kv_budget(cfg, self.model_cfg) // per_block)
        layout = self._agree(KvLayout(num_blocks=capacity, block_size=bs))
        n = layout.num_blocks
        c = self.model_cfg
        # On CPU the pool is left as the OS hands it over: a block is always written before
        # a kernel reads it (padding rows included; tests/kernels/test_cpu_forward.py fills it
        # with noise first), and zeroing 1 GiB up front cost 1-2 s of every start. One byte of
        # each page is written now (0.3 s for 1 GiB here) instead of the page being faulted in
        # by the step that first stores a block there: a 256-token prompt's KV took ~1,500
        # faults, ~1.5 ms of its prefill, until the pool had been used once. Zeros elsewhere
        # (graph padding on CUDA).
        alloc = torch.empty if self.device.type == "cpu" else torch.zeros
        self.kv_cache = alloc(c.num_layers, 2, n, bs, c.num_kv_heads, pool_row(c.head_dim, kv_dtype),
                              dtype=kv_dtype, device=self.device)
        if draft_kv is not None:
            self.draft_kv = alloc(2, n, bs, *draft_kv, dtype=self.dtype, device=self.device)
        if self.device.type == "cpu":
            for pool in (self.kv_cache, self.draft_kv):
                if pool is not None:
                    flat = pool.view(-1).view(torch.uint8)
                    flat[::mmap.PAGESIZE].zero_()
                    flat[-1:].zero_()  # the last page, where the pool does not start on a page
        self.max_model_len = min(self.max_model_len, n * bs)
        self.aux_layers, self.keep_hidden = tuple(aux_layers), keep_hidden
        on_cuda = self.device.type == "cuda"
        use_graphs = ((cfg.graph_mode == "auto" and on_cuda) or cfg.graph_mode == "buffers") and not keep_hidden
        if use_graphs and isinstance(self.model, LlamaModel):
            self.graphs = DecodeGraphs(self.model, self.kv_cache, bs, self.aux_layers, cfg.max_num_seqs,
                                       self.max_model_len, capture=on_cuda and cfg.graph_mode == "auto")
            if draft_kv is not None and self.tp.world == 1:  # device drafts: their verify replays too
                self.verify_graphs = VerifyGraphs(self.model, self.kv_cache, bs, self.aux_layers, cfg.max_num_seqs,
                                                  self.graphs.max_blocks)
        return layout

    def capture_verify(self, nodes: list[int]) -> None:
        """The verify buffers for T tokens a row, each T in `nodes` (the drafter shapes' node
        counts), and where the decode steps replay CUDA graphs, the verify's for every bucket."""
        if self.verify_graphs is not None and nodes:
            self.verify_graphs.reserve(nodes, pool=self.graphs.pool if self.graphs.graphs else None)

    def _agree(self, mine: KvLayout) -> KvLayout:
        """Rank 0 learns every rank's capacity, keeps the smallest and broadcasts the layout."""
        if self.tp.world == 1:
            return mine
        capacities = self.tp.gather_int(mine.num_blocks)
        payload = self._encoder.encode(KvLayout(min(capacities), mine.block_size)) if self.tp.rank == 0 else b""
        return msgspec.msgpack.decode(self.tp.broadcast_bytes(payload), type=KvLayout)

    @torch.inference_mode()
    def enable_narrow(self, prompts_from: int | None, prompts, decodes: bool = False) -> bool:
        """Narrow (int8) prompt rows for prompts of `prompts_from` tokens or more (None: none;
        `EngineConfig.prefill_activations`) and, with `decodes`, narrow plain decode rows
        (`EngineConfig.decode_activations`); the C++ CPU step only: elsewhere False. Their
        outlier columns come from a kept calibration of this build (replica.model.built) or
        from one step over prompts() (token ids; called only then), all rows wide, in the
        pool's first blocks (before serving: nothing is cached there yet), then kept.
        False, and every row stays wide, when there is nothing to calibrate on."""
        if not isinstance(self.model, cpu_model.CpuModel):
            return False
        mats = self.model.linears()
        cols = built.kept_outliers(self.cfg, self.model_cfg, self.ops)
        if cols is not None and (len(cols) != len(mats) or any(
                not all(0 <= i < lin.in_features for i in c) for c, (lin, _) in zip(cols, mats))):
            cols = None  # kept for another shape of model
        if cols is None:
            ids = prompts()
            if not ids:
                return False
            bs, cap, tables, used = self.block_size, self.kv_cache.shape[2], [], 0
            whole = sum(-(-len(p) // bs) for p in ids) <= cap
            if not whole:  # a pool too small for them all (tests): as many tokens as it holds, not kept
                ids = [ids[0][: cap * bs]]
            for p in ids:
                n = -(-len(p) // bs)
                tables.append(list(range(used, used + n)))
                used += n
            plan = StepPlan(input_ids=[t for p in ids for t in p], starts=[0] * len(ids),
                            num_tokens=[len(p) for p in ids], block_tables=tables, sample_rows=[], num_decodes=0)
            input_ids, positions, ctx, _ = self.prepare(plan)
            cols = self.model.calibrate(lambda: self.model(input_ids, positions, ctx, self.kv_cache))
            if whole:
                built.keep_outliers(self.cfg, self.model_cfg, self.ops, cols)
        self.model.set_outliers(cols)
        self.narrow_from, self.narrow_decodes = prompts_from, decodes
        return True

    @torch.inference_mode()
    def move_kv(self, src, dst) -> None:
        """Copy the KV of slot src[i] to slot dst[i] in every layer (accepted drafts
        moving down to their final positions). The sources are gathered before any
        destination is written, so overlapping moves are safe. src, dst: lists of slots, or
        int64 tensors on the device (one rank only: moves ride in the next plan as host data)."""
        if isinstance(src, torch.Tensor):
            assert self.tp.world == 1, "a tensor-parallel group moves KV by the plan's host lists"
        elif not src:
            return
        else:
            if self.tp.world > 1 and self.tp.rank == 0:
                self._kv_moves += [x for pair in zip(src, dst) for x in pair]  # sent with the next plan
            src, dst = self._tensor(src, torch.int64), self._tensor(dst, torch.int64)
        flat = self.kv_cache.flatten(2, 3)  # (L, 2, slots, Hkv, D), a view (int8: D + 4, the scale moves too)
        flat[:, :, dst] = flat[:, :, src]

    # -- the step --------------------------------------------------------------------------
    def _tensor(self, data, dtype):
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def block_tables(self, tables: list[list[int]]) -> torch.Tensor:
        """(B, max_blocks) int32, rows padded with block 0 (never read past a length)."""
        width = max(len(t) for t in tables)
        return self._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32)

    def prepare(self, plan: StepPlan, drafts=None):
        """Input ids, positions, the attention Context, and the logits rows (token indices).
        drafts: the device trees of rows [0, plan.draft_rows) (speculative.drafting.Drafts):
        their positions and tree mask are made on the device from its parents and depths."""
        bs, nt = self.block_size, len(plan.trees) + plan.draft_rows
        pos, slots, last = [], [], []
        for i, (start, n, table) in enumerate(zip(plan.starts, plan.num_tokens, plan.block_tables)):
            if i < len(plan.trees):
                pos.extend(start + d for d in tree_depths(plan.trees[i]))
            else:  # (a device tree's nodes: start, their depths added below)
                pos.extend([start] * n if i < nt else range(start, start + n))
            slots.extend(slot(table, p, bs) for p in range(start, start + n))  # node j: the slot of start + j
            last.append(len(pos) - 1)
        cu = [0]
        for n in plan.num_tokens:
            cu.append(cu[-1] + n)
        rows = list(range(cu[nt])) + [last[i] for i in plan.sample_rows] + list(plan.extra_logits)
        slot_mapping = self._tensor(slots, torch.int64)
        positions = self._tensor(pos, torch.int64)
        if plan.draft_rows:
            positions[: cu[nt]] += drafts.depths.flatten()
        if nt:  # every row through tree attention: a plain row is a chain (the causal mask)
            if plan.draft_rows:  # causal everywhere, then the trees' ancestors
                local = self._tensor([j for n in plan.num_tokens for j in range(n)], torch.int64)
                mask = torch.arange(max(plan.num_tokens), device=self.device) <= local[:, None]
                mask[: cu[nt], : drafts.nodes] = ancestor_masks(drafts.parents, drafts.depth).flatten(0, 1)
            else:
                masks = [ancestor_mask(p) for p in plan.trees] + [torch.ones(n, n, dtype=torch.bool).tril()
                                                                  for n in plan.num_tokens[nt:]]
                mask = torch.zeros(cu[-1], max(plan.num_tokens), dtype=torch.bool)
                for i, m in enumerate(masks):
                    mask[cu[i] : cu[i + 1], : m.shape[0]] = m
                mask = mask.to(self.device, non_blocking=True)
            prefix = self._tensor(plan.starts, torch.int32)
            cu_t = self._tensor(cu, torch.int32)
            ctx = Context(slot_mapping=slot_mapping, num_decode_tokens=0, decode_block_tables=None,
                          decode_seq_lens=None, extend_block_tables=self.block_tables(plan.block_tables),
                          extend_cu_seqlens_q=cu_t, extend_seq_lens=prefix + (cu_t[1:] - cu_t[:-1]),
                          tree_mask=mask, tree_prefix_lens=prefix)
        else:
            nd = plan.num_decodes
            ext_n = plan.num_tokens[nd:]
            ctx = Context(
                slot_mapping=slot_mapping,
                num_decode_tokens=nd,
                decode_block_tables=self.block_tables(plan.block_tables[:nd]) if nd else None,
                # a decode computes the token at position `start`: the sequence holds start + 1
                decode_seq_lens=self._tensor([s + 1 for s in plan.starts[:nd]], torch.int32) if nd else None,
                extend_block_tables=self.block_tables(plan.block_tables[nd:]) if ext_n else None,
                extend_cu_seqlens_q=self._tensor([c - cu[nd] for c in cu[nd:]], torch.int32) if ext_n else None,
                extend_seq_lens=self._tensor([s + n for s, n in zip(plan.starts[nd:], ext_n)], torch.int32)
                if ext_n else None,
            )
        if self.narrow_from is not None or self.narrow_decodes:
            narrow = narrow_rows(plan, cu, self.narrow_from, self.narrow_decodes)
            ctx.narrow_rows = self._tensor(narrow, torch.bool) if any(narrow) else None
        pruned = not self.keep_hidden and len(set(rows)) < len(plan.input_ids)
        rows = self._tensor(rows, torch.int64)
        if pruned:  # only the logits rows' states are read
            ctx.logits_rows = rows
        return self._tensor(plan.input_ids, torch.int64), positions, ctx, rows

    @torch.inference_mode()
    def execute(self, plan: StepPlan, prev_tokens: torch.Tensor | None = None, seqs=None,
                constrain=None, drafts=None) -> StepOutput:
        """Run one step and sample each logits row. With overlap, input id placeholder(j)
        (replica.model.plan) stands for prev_tokens[j], the previous step's j-th sampled token,
        still on the device: it is resolved there, without waiting for the host. seqs (rank 0):
        the sequences of plan.sample_rows, whose params beyond temperature/top-k/top-p
        (penalties, logit bias, logprobs: replica.model.sampler) apply to their rows.
        constrain(x, first_row) (rank 0): grammar masks, applied to the logits rows
        before sampling, once the forward is queued (replica.engine.grammar). drafts (one
        rank): the device trees of plan.draft_rows (speculative.drafting.Drafts), whose tokens
        the placeholders of those rows stand for."""
        assert bool(plan.draft_rows) == (drafts is not None) and not (drafts is not None and self.tp.world > 1)
        if self.tp.world > 1 and self.tp.rank == 0:
            if self._kv_moves:
                plan, self._kv_moves = msgspec.structs.replace(plan, kv_moves=self._kv_moves), []
            self.tp.broadcast_bytes(self._encoder.encode(plan))
        if (self.graphs is not None and not plan.trees and not plan.draft_rows and not plan.extra_logits
                and plan.num_decodes == len(plan.starts) and self.graphs.bucket_for(plan.num_decodes) is not None):
            logits, aux = self.graphs.run(plan, prev_tokens)  # pure decode: replay (every row samples)
            hidden = None
        elif self.verify_graphs is not None and self.verify_graphs.fits(plan, drafts):
            logits, aux = self.verify_graphs.run(plan, drafts)  # pure verify: every node a logits row
            hidden = None
        else:
            input_ids, positions, ctx, rows = self.prepare(plan, drafts)
            input_ids = resolve_placeholders(input_ids, drafts.tokens.flatten() if drafts is not None else prev_tokens)
            out = self.model(input_ids, positions, ctx, self.kv_cache, self.aux_layers)
            hidden, aux = (out[0], torch.cat(out[1], -1)) if self.aux_layers else (out, None)
            logits = self.model.compute_logits(hidden[rows]).float()
        n = len(plan.sampling)
        logits, prompt_logits = logits[:n], (logits[n:] if plan.extra_logits else None)
        depths = drafts.depths.flatten() if drafts is not None else None  # the nodes' sampling positions past start + 1
        tokens, logprobs = self.sampler(logits, plan, prev_tokens, seqs, constrain, depths)
        return StepOutput(logits, tokens, aux, hidden if self.keep_hidden else None, logprobs, prompt_logits)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits of final hidden states (StepOutput.hidden)."""
        with torch.inference_mode():
            return self.model.compute_logits(hidden).float()

    def to_host(self, tokens: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Start copying sampled tokens to the host; returns (host tensor, event to wait on).
        Waiting on the event waits for this step only, not for steps queued after it."""
        if tokens.device.type != "cuda":
            return tokens, None
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    # -- tensor-parallel ranks -------------------------------------------------------------
    def loop(self) -> None:
        """Ranks 1..N-1: execute every plan rank 0 broadcasts, until it broadcasts the end."""
        decoder = msgspec.msgpack.Decoder(StepPlan)
        prev = None  # this rank's copy of the previous step's tokens (overlap placeholders)
        while (payload := self.tp.broadcast_bytes(b"")) is not None:
            plan = decoder.decode(payload)
            if plan.kv_moves:  # rank 0's accepted drafts, moved there after the last step
                self.move_kv(plan.kv_moves[0::2], plan.kv_moves[1::2])
            prev = self.execute(plan, prev).tokens
        self.tp.close()

    def close(self) -> None:
        """Rank 0: release the other ranks' loops and leave the group."""
        if self.tp.world > 1:
            self.tp.broadcast_bytes(None)
            self.tp.close()

    # -- KV export and import (replica.engine.kv_transfer) -----------------------------------
    def kv_pools(self) -> list[tuple[torch.Tensor, int]]:
        """The pools a block spans, in the order it travels, with their block dimension: every layer's
        k and v (L, 2, blocks, bs, Hkv, row), then the draft head's layer (2, blocks, bs, Hkv', D')."""
        return [(self.kv_cache, 2)] + ([(self.draft_kv, 1)] if self.draft_kv is not None else [])

    def _block_parts(self, b: int) -> list[torch.Tensor]:
        """Block b's views, in the order a block travels. Strided views into the pool, no copy."""
        return [t.select(d, b) for t, d in self.kv_pools()]

    def block_nbytes(self) -> int:
        """Bytes of one block as it travels (KvSpec.block_bytes)."""
        return sum(t.numel() * t.element_size() for t in self._block_parts(0))

    @torch.inference_mode()
    def read_blocks(self, ids: list[int], out: bytearray) -> None:
        """Copy blocks `ids` into `out` (len(ids) * block_nbytes() bytes): on CPU the pool's strided
        views straight into the buffer, one copy a block; on CUDA gathered on the device and copied
        once through pinned staging (replica.model.kv_staging)."""
        self._move(ids, out, to_pool=False)

    @torch.inference_mode()
    def write_blocks(self, ids: list[int], data: bytearray) -> None:
        """Copy `data` (len(ids) * block_nbytes() bytes, laid out as read_blocks writes it) into blocks `ids`."""
        self._move(ids, data, to_pool=True)

    def _move(self, ids: list[int], buf: bytearray, to_pool: bool) -> None:
        per = self.block_nbytes()
        assert len(buf) == len(ids) * per, f"{len(buf)} bytes for {len(ids)} blocks of {per}"
        if not ids:
            return
        flat = torch.frombuffer(buf, dtype=torch.uint8)  # shares buf's memory
        if self.kv_cache.device.type == "cuda":
            if self._staging is None:
                self._staging = KvStaging(pin=True)
            (self._staging.write if to_pool else self._staging.read)(self.kv_pools(), ids, flat)
            return
        offset = 0
        for b in ids:
            for t in self._block_parts(b):
                n = t.numel() * t.element_size()
                host = flat[offset: offset + n].view(t.dtype).view(t.shape)
                (t if to_pool else host).copy_(host if to_pool else t)
                offset += n


def narrow_rows(plan: StepPlan, cu: list[int], prompts_from: int | None = 0, decodes: bool = False) -> list[bool]:
    """Per token of the plan: whether its matmul activations are int8.
    `EngineConfig.prefill_activations`: a token of a prefill chunk before its prompt's last,
    in a sequence whose prompt has at least `prompts_from` tokens (None: no prompt token): its
    only output is the KV it leaves. Wide (int16) stay every token whose logits are computed
    (a tree node, a decode, the prompt's last token, a prompt logprob's position) and every
    generated token a resumed sequence computes again, so a resume leaves the KV the first
    computation left.
    `decodes` (`EngineConfig.decode_activations` "int8", steps without drafts): the plain
    decode rows are narrow too, and so are the generated tokens a resume computes again, the
    one that samples too: each was, or would have been, a decode row."""
    narrow = [False] * cu[-1]
    decodes = decodes and not plan.trees and not plan.draft_rows
    if decodes:
        narrow[: cu[plan.num_decodes]] = [True] * cu[plan.num_decodes]
    first_extend = len(plan.trees) + plan.draft_rows + plan.num_decodes
    for i in range(first_extend, len(plan.num_tokens) if plan.prompt_lens else 0):
        start, n, prompt = plan.starts[i], plan.num_tokens[i], plan.prompt_lens[i]
        if prompts_from is not None and prompt >= prompts_from:
            end = min(start + n, prompt - 1)  # positions [start, end) are narrow
            narrow[cu[i] : cu[i] + max(0, end - start)] = [True] * max(0, end - start)
        if decodes and start + n > prompt:  # generated tokens computed again
            first = max(start, prompt)
            narrow[cu[i] + first - start : cu[i] + n] = [True] * (start + n - first)
    for j in plan.extra_logits:
        narrow[j] = False
    return narrow


def materialize(model: torch.nn.Module, device) -> torch.nn.Module:
    """Module.to_empty without its detour: each meta parameter and buffer becomes an
    uninitialised tensor of the same shape and dtype on `device`, allocated directly
    (to_empty's empty_like on meta tensors goes through torch._refs and imports sympy,
    0.6 s of a replica's start)."""
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None:
                mod._parameters[name] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                           requires_grad=p.requires_grad)
        for name, b in mod._buffers.items():
            if b is not None:
                mod._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    return model


def build_model(model_cfg: ModelConfig, cfg: EngineConfig, weights: dict | None, ops, max_positions: int, tp=None):
    dtype = DTYPES[cfg.dtype]
    with torch.device("meta"):
        model = LlamaModel(model_cfg, ops, max_positions, tp)
    # Cast on meta, then allocate: an 8B model never exists in fp32 (32 GB) on its way to bf16.
    model = materialize(model.to(dtype), cfg.device)
    # Buffers made on meta are empty: rebuild the rotary table for real (kept in fp32).
    model.cos_sin = LlamaModel.rope_table(model_cfg, max_positions).to(cfg.device)
    if cfg.quantization != "none":
        # Linears first, from the checkpoint straight to their quantized form: the model's dense
        # ones are allocated but never written, so they never take memory; then the rest (the
        # QLinears' biases too). A loaded dense model beside the quantizer's work peaked at 1.3x
        # the checkpoint (fp32).
        quantize_model(model, cfg.quantization, weights, gguf_stored(cfg, model_cfg))
        weights = {n: weights[n] for n in weights if not (n.endswith("_proj.weight") or n == "lm_head.weight")}
    if weights is not None:
        model.load_weights(weights)  # copy_ rounds each fp32 tensor to the parameter's dtype
    return for_device(model.eval(), cfg)


def for_device(model: LlamaModel, cfg: EngineConfig) -> torch.nn.Module:
    """What serves a built model: on CPU with the C++ step (the model's kernel set says),
    a packed fp32 model as one C++ call per step (the CPU's "graph"); else the model."""
    if model.ops.cpu_step and cfg.graph_mode == "auto":
        if cpu_model.supports(model, DTYPES[cfg.dtype]):
            return cpu_model.CpuModel(model, cfg.engine_threads()).eval()
    return model


def gguf_stored(cfg: EngineConfig, model_cfg: ModelConfig) -> dict | None:
    """The GGUF file's own quantized tensors when serving them as-is (--quantization gguf)."""
    if cfg.quantization != "gguf" or cfg.random_weights:
        return None
    path = resolve_model(cfg.model)
    return load_gguf_quantized(path, model_cfg) if path.endswith(".gguf") else None
