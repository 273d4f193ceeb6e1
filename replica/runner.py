"""Runs one scheduled batch: builds step metadata, runs the model, samples.

Owns the model, the KV pool (one tensor: layers x {k, v} x blocks x block_size x
Hkv x D) and the op set chosen for the device at start-up.
"""

from __future__ import annotations

import msgspec
import torch

from replica.config import EngineConfig, ModelConfig
from replica.graphs import DecodeGraphs, resolve_placeholders
from replica import sampling
from replica.model import Context, LlamaModel
from replica.scheduler import Batch


class StepPlan(msgspec.Struct, array_like=True):
    """One step as plain data. Row i computes num_tokens[i] tokens starting at
    position starts[i]; decode rows (one token each) come first."""

    input_ids: list[int]  # all rows' tokens, flattened
    starts: list[int]
    num_tokens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # rows whose last token's logits are sampled
    num_decodes: int
    # Tensor parallel with overlap: every rank samples the step itself (the logits are
    # all-gathered, sampling is a pure function of them and of these), so each has the
    # tokens its next step's placeholders stand for. Per sampled row:
    sampling: list[tuple[float, int, float, int, int]] = []  # (temperature, top_k, top_p, seed, position)
    extra_logits: list[int] = []  # flat token indices whose logits follow the sampled rows' (prompt logprobs)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.kv_size * dtype.itemsize


class Runner:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, model: torch.nn.Module, ops, num_blocks: int,
                 max_model_len: int, aux_layers: tuple = ()):
        self.model_cfg, self.cfg, self.model, self.ops = model_cfg, cfg, model, ops
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        self.block_size = cfg.block_size
        self.kv_cache = torch.zeros(model_cfg.num_layers, 2, num_blocks, cfg.block_size, model_cfg.num_kv_heads,
                                    model_cfg.head_dim, dtype=self.dtype, device=self.device)
        on_cuda = self.device.type == "cuda"
        use_graphs = (cfg.graph_mode == "auto" and on_cuda) or cfg.graph_mode == "buffers"
        capture = on_cuda and cfg.graph_mode == "auto"
        self.graphs = DecodeGraphs(self, cfg.max_num_seqs, max_model_len, capture, aux_layers) \
            if use_graphs and isinstance(model, LlamaModel) else None

    def _tensor(self, data, dtype):
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def block_tables(self, tables: list[list[int]]) -> torch.Tensor:
        """(B, max_blocks) int32, rows padded with block 0 (never read past a length)."""
        width = max(len(t) for t in tables)
        return self._tensor([t + [0] * (width - len(t)) for t in tables], torch.int32)

    @staticmethod
    def plan(batch: Batch) -> StepPlan:
        """The step as plain data: what rank 0 broadcasts to tensor-parallel ranks."""
        ids, starts, tables, sample_rows = [], [], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start = seq.num_computed
            ids.extend(seq.token_ids[start : start + n])
            starts.append(start)
            tables.append(seq.block_table)
            if start + n == len(seq):
                sample_rows.append(i)
        return StepPlan(input_ids=ids, starts=starts, num_tokens=list(batch.num_tokens), block_tables=tables,
                        sample_rows=sample_rows, num_decodes=batch.num_decodes)

    def prepare(self, plan: StepPlan):
        """Input ids, positions, the attention Context, and the rows to compute logits for."""
        bs = self.block_size
        pos, slots, last = [], [], []
        for start, n, table in zip(plan.starts, plan.num_tokens, plan.block_tables):
            pos.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            last.append(len(pos) - 1)
        nd = plan.num_decodes
        ext_n = plan.num_tokens[nd:]
        cu = [0]
        for n in ext_n:
            cu.append(cu[-1] + n)
        ctx = Context(
            slot_mapping=self._tensor(slots, torch.int64),
            num_decode_tokens=nd,
            decode_block_tables=self.block_tables(plan.block_tables[:nd]) if nd else None,
            # a decode computes the token at position `start`: the sequence holds start + 1
            decode_seq_lens=self._tensor([s + 1 for s in plan.starts[:nd]], torch.int32) if nd else None,
            extend_block_tables=self.block_tables(plan.block_tables[nd:]) if ext_n else None,
            extend_cu_seqlens_q=self._tensor(cu, torch.int32) if ext_n else None,
            extend_seq_lens=self._tensor([s + n for s, n in zip(plan.starts[nd:], ext_n)], torch.int32)
            if ext_n else None,
        )
        sample_idx = [last[i] for i in plan.sample_rows] + plan.extra_logits
        return self._tensor(plan.input_ids, torch.int64), self._tensor(pos, torch.int64), ctx, sample_idx

    @torch.inference_mode()
    def forward_logits(self, plan: StepPlan, prev_tokens: torch.Tensor | None = None, aux_layers: tuple = ()):
        """fp32 logits for the last token of each row in plan.sample_rows (the
        sequences whose uncomputed tokens all run this step). With overlap, input id
        -(j + 1) stands for prev_tokens[j], the previous step's j-th sampled token,
        still on the device: it is resolved there, without waiting for the host.

        With aux_layers (an EAGLE-3 head drafts), returns (logits, aux): aux (T, 3h)
        holds the residual streams after those layers for every token of the step
        (the decode graphs capture them when built with the same aux_layers)."""
        if self.graphs is not None and tuple(aux_layers) == self.graphs.aux_layers \
                and plan.num_decodes == len(plan.starts) and self.graphs.bucket_for(plan.num_decodes) is not None:
            return self.graphs.run(plan, prev_tokens)  # pure decode: replay (every row samples)
        input_ids, positions, ctx, sample_idx = self.prepare(plan)
        input_ids = resolve_placeholders(input_ids, prev_tokens)
        if not aux_layers:
            hidden = self.model(input_ids, positions, ctx, self.kv_cache)
            return self.model.compute_logits(hidden[sample_idx]).float()
        hidden, aux = self.model(input_ids, positions, ctx, self.kv_cache, aux_layers)
        return self.model.compute_logits(hidden[sample_idx]).float(), torch.cat(aux, -1)

    @torch.inference_mode()
    def move_kv(self, src: list[int], dst: list[int]) -> None:
        """Copy the KV of slot src[i] to slot dst[i] in every layer (accepted drafts
        moving down to their final positions). The sources are gathered before any
        destination is written, so overlapping moves are safe."""
        if not src:
            return
        flat = self.kv_cache.flatten(2, 3)  # (L, 2, slots, Hkv, D), a view
        flat[:, :, self._tensor(dst, torch.int64)] = flat[:, :, self._tensor(src, torch.int64)]

    @staticmethod
    def sampling_of(seqs) -> list[tuple[float, int, float, int, int]]:
        """(temperature, top_k, top_p, seed, position of the sampled token) per sequence."""
        return [(s.sampling.temperature, s.sampling.top_k, s.sampling.top_p, s.seed, len(s)) for s in seqs]

    def sample(self, logits: torch.Tensor, seqs) -> torch.Tensor:
        """Sample one token per row as the engine does (logits processing, logprobs kept
        on the sequences); randomness depends on (seed, position, tokens so far) only."""
        return sampling.sample_now(self, logits, seqs)

    @torch.inference_mode()
    def sample_params(self, logits: torch.Tensor, params: list[tuple[float, int, float, int, int]]) -> torch.Tensor:
        """Greedy rows take a plain argmax; only rows that sample pay for filtering
        and hashed noise (which rows is known on the host: no device sync)."""
        hot = [i for i, p in enumerate(params) if p[0] > 0]
        tokens = logits.argmax(-1)
        if hot:
            temp, top_k, top_p, seed, pos = zip(*(params[i] for i in hot))
            rows = logits if len(hot) == len(params) else logits[self._tensor(hot, torch.int64)]
            sampled = self.ops.sample(rows, self._tensor(temp, torch.float32), self._tensor(top_k, torch.int32),
                                      self._tensor(top_p, torch.float32), self._tensor(seed, torch.int64),
                                      self._tensor(pos, torch.int64))
            if len(hot) == len(params):
                tokens = sampled
            else:
                tokens[self._tensor(hot, torch.int64)] = sampled
        return tokens

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


def build_model(model_cfg: ModelConfig, cfg: EngineConfig, weights: dict | None, ops, max_positions: int, tp=None):
    dtype = DTYPES[cfg.dtype]
    with torch.device("meta"):
        model = LlamaModel(model_cfg, ops, max_positions, tp)
    model = model.to_empty(device=cfg.device)
    # Buffers made on meta are empty: rebuild the rotary table for real.
    model.cos_sin = LlamaModel.rope_table(model_cfg, max_positions).to(cfg.device)
    if weights is not None:
        model.load_weights(weights)
    model = model.to(dtype)
    model.cos_sin = model.cos_sin.float()
    return model.eval()
