"""Runs one scheduled batch: builds step metadata, runs the model, samples.

Owns the model, the KV pool (one tensor: layers x {k, v} x blocks x block_size x
Hkv x D) and the op set chosen for the device at start-up.
"""

from __future__ import annotations

import torch

from replica.config import EngineConfig, ModelConfig
from replica.model import Context, LlamaModel
from replica.scheduler import Batch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * block_size * cfg.kv_size * dtype.itemsize


class Runner:
    def __init__(self, model_cfg: ModelConfig, cfg: EngineConfig, model: torch.nn.Module, ops, num_blocks: int):
        self.model_cfg, self.cfg, self.model, self.ops = model_cfg, cfg, model, ops
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        self.block_size = cfg.block_size
        self.kv_cache = torch.zeros(model_cfg.num_layers, 2, num_blocks, cfg.block_size, model_cfg.num_kv_heads,
                                    model_cfg.head_dim, dtype=self.dtype, device=self.device)

    def _tensor(self, data, dtype):
        return torch.tensor(data, dtype=dtype).to(self.device, non_blocking=True)

    def _block_tables(self, seqs) -> torch.Tensor:
        width = max(len(s.block_table) for s in seqs)
        return self._tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], torch.int32)

    def prepare(self, batch: Batch):
        """Flatten the batch into input ids, positions and the attention Context."""
        bs = self.block_size
        ids, pos, slots = [], [], []
        sample_idx = []  # row of each sampling sequence's last token
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start = seq.num_computed
            ids.extend(seq.token_ids[start : start + n])
            pos.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if start + n == len(seq):
                sample_idx.append(len(ids) - 1)
        nd = batch.num_decodes
        dec, ext = batch.seqs[:nd], batch.seqs[nd:]
        cu = [0]
        for n in batch.num_tokens[nd:]:
            cu.append(cu[-1] + n)
        ctx = Context(
            slot_mapping=self._tensor(slots, torch.int64),
            num_decode_tokens=nd,
            decode_block_tables=self._block_tables(dec) if dec else None,
            decode_seq_lens=self._tensor([len(s) for s in dec], torch.int32) if dec else None,
            extend_block_tables=self._block_tables(ext) if ext else None,
            extend_cu_seqlens_q=self._tensor(cu, torch.int32) if ext else None,
            extend_seq_lens=self._tensor([s.num_computed + n for s, n in zip(ext, batch.num_tokens[nd:])],
                                         torch.int32) if ext else None,
        )
        return self._tensor(ids, torch.int64), self._tensor(pos, torch.int64), ctx, sample_idx

    @torch.inference_mode()
    def forward_logits(self, batch: Batch) -> tuple[torch.Tensor, list[int]]:
        """Logits (fp32) for the last token of each sequence that completes its
        uncomputed tokens this step; also returns which batch rows those are."""
        input_ids, positions, ctx, sample_idx = self.prepare(batch)
        hidden = self.model(input_ids, positions, ctx, self.kv_cache)
        logits = self.model.compute_logits(hidden[sample_idx]).float()
        rows = [i for i, (s, n) in enumerate(zip(batch.seqs, batch.num_tokens)) if s.num_computed + n == len(s)]
        return logits, rows

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs) -> list[int]:
        """Sample one token per row; randomness depends on (seed, position) only.

        Greedy rows take a plain argmax; only rows that sample pay for filtering
        and hashed noise (which rows is known on the host: no device sync)."""
        hot = [i for i, s in enumerate(seqs) if s.sampling.temperature > 0]
        tokens = logits.argmax(-1)
        if hot:
            sp = [seqs[i].sampling for i in hot]
            rows = logits if len(hot) == len(seqs) else logits[self._tensor(hot, torch.int64)]
            sampled = self.ops.sample(
                rows,
                self._tensor([p.temperature for p in sp], torch.float32),
                self._tensor([p.top_k for p in sp], torch.int32),
                self._tensor([p.top_p for p in sp], torch.float32),
                self._tensor([seqs[i].seed for i in hot], torch.int64),
                self._tensor([len(seqs[i]) for i in hot], torch.int64),  # position of the sampled token
            )
            if len(hot) == len(seqs):
                tokens = sampled
            else:
                tokens[self._tensor(hot, torch.int64)] = sampled
        return tokens.tolist()  # the one host sync per step: tokens go to the API process


def build_model(model_cfg: ModelConfig, cfg: EngineConfig, weights: dict | None, ops, max_positions: int):
    dtype = DTYPES[cfg.dtype]
    with torch.device("meta"):
        model = LlamaModel(model_cfg, ops, max_positions)
    model = model.to_empty(device=cfg.device)
    # Buffers made on meta are empty: rebuild the rotary table for real.
    model.cos_sin = LlamaModel.rope_table(model_cfg, max_positions).to(cfg.device)
    if weights is not None:
        model.load_weights(weights)
    model = model.to(dtype)
    model.cos_sin = model.cos_sin.float()
    return model.eval()
