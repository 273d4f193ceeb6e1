"""Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM2) over a paged KV cache.

    h   = x + Attention(RMSNorm(x))          # GQA, RoPE on q and k
    out = h + MLP(RMSNorm(h))                 # SwiGLU: down(silu(gate(h)) * up(h))

Tokens of all sequences in a step are flattened into one (T, hidden) batch; the
per-step `Context` says where each token's K/V goes (slot_mapping) and what each
query attends to (block tables, lengths). The hot ops (norms, rotary, KV store,
attention, SwiGLU) come from `kernels.ops(device)`: Triton on CUDA, the PyTorch
references on CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from replica.config import ModelConfig
from replica.model.tp import TensorParallel


@dataclass
class Context:
    """Per-forward attention metadata. Tokens of the `num_decodes` decode sequences
    come first (one each), then the extend (prefill-chunk) sequences."""

    slot_mapping: torch.Tensor  # (T,) int64: pool slot of each token's K/V
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # (Bd, max_blocks) int32
    decode_seq_lens: torch.Tensor | None  # (Bd,) int32, including the new token
    extend_block_tables: torch.Tensor | None  # (Be, max_blocks) int32
    extend_cu_seqlens_q: torch.Tensor | None  # (Be + 1,) int32
    extend_seq_lens: torch.Tensor | None  # (Be,) int32, cached + new tokens
    # Speculative verification: every token is a draft-tree node; node i of sequence b
    # attends to b's tree_prefix_lens[b] cached tokens plus the nodes tree_mask[i] allows.
    tree_mask: torch.Tensor | None = None  # (T, max_n) bool
    tree_prefix_lens: torch.Tensor | None = None  # (B,) int32
    # The C++ CPU step (replica.model.cpu_model): rows whose matmul activations may be rounded
    # narrow (int8, kernels/qgemm_cpu.py); None: every row wide. Others ignore it.
    narrow_rows: torch.Tensor | None = None  # (T,) bool
    # The C++ CPU step: the rows whose final hidden states are read (logits rows); it computes the
    # last layer past its KV store for those alone, the others' hidden states left zero. None: all.
    # Others ignore it.
    logits_rows: torch.Tensor | None = None  # (R,) int64


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """RoPE inverse frequencies, with Llama-3 or linear scaling when configured."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64, device="cpu") / d))
    sc = config.rope_scaling
    if sc is None:
        return inv_freq.float()
    if sc.rope_type == "linear":
        return (inv_freq / sc.factor).float()
    # Llama 3: keep high frequencies, divide low ones by `factor`, blend in between.
    low_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
    high_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / sc.factor, inv_freq)
    mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(mid, (1 - smooth) * inv_freq / sc.factor + smooth * inv_freq, scaled).float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, ops):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, tp: TensorParallel):
        super().__init__()
        self.cfg, self.ops, self.tp = cfg, ops, tp
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, positions, ctx: Context, k_cache, v_cache, cos_sin):
        cfg, ops = self.cfg, self.ops
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.reshape(T, cfg.num_heads, cfg.head_dim)  # (T, H, D)
        k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)  # (T, Hkv, D)
        v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        if ops.rope_store is not None:  # kernels.ops(..., fused_decode=True): one launch for both
            q = ops.rope_store(q, k, v, positions, cos_sin, k_cache, v_cache, ctx.slot_mapping)
        else:
            q, k = ops.apply_rotary(q, k, positions, cos_sin)
            ops.store_kvcache(k, v, k_cache, v_cache, ctx.slot_mapping)
        nd = ctx.num_decode_tokens
        if ctx.tree_mask is not None:
            o = ops.paged_tree_attention(q, k_cache, v_cache, ctx.extend_block_tables, ctx.extend_cu_seqlens_q,
                                         ctx.tree_prefix_lens, ctx.tree_mask, self.scale)
        elif nd == T:
            o = ops.paged_decode_attention(q, k_cache, v_cache, ctx.decode_block_tables, ctx.decode_seq_lens, self.scale)
        elif nd == 0:
            o = ops.paged_extend_attention(q, k_cache, v_cache, ctx.extend_block_tables, ctx.extend_cu_seqlens_q,
                                           ctx.extend_seq_lens, self.scale)
        else:
            o = torch.cat([
                ops.paged_decode_attention(q[:nd], k_cache, v_cache, ctx.decode_block_tables, ctx.decode_seq_lens,
                                           self.scale),
                ops.paged_extend_attention(q[nd:], k_cache, v_cache, ctx.extend_block_tables,
                                           ctx.extend_cu_seqlens_q, ctx.extend_seq_lens, self.scale),
            ])
        return self.tp.all_reduce(self.o_proj(o.reshape(T, cfg.q_size)))  # row-parallel


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, tp: TensorParallel):
        super().__init__()
        self.ops, self.tp = ops, tp
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.tp.all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x))))  # row-parallel


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, ops, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, ops, tp)

    def forward(self, x, residual, positions, ctx, k_cache, v_cache, cos_sin):
        # Pre-norm residual stream; the residual add is fused into the next norm.
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, ctx, k_cache, v_cache, cos_sin)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """cfg is this rank's shape (replica.model.tp.local_config) when tensor-parallel."""

    def __init__(self, cfg: ModelConfig, ops, max_positions: int, tp: TensorParallel | None = None):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.tp = tp = tp or TensorParallel()
        vocab = cfg.vocab_size // tp.world  # vocab-parallel embedding and head
        # Built on meta and loaded (runner.build_model): no init draw. A meta normal_ would
        # also import torch._dynamo, 4 s of a replica's start.
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size, _weight=torch.empty(vocab, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, vocab, bias=False)
        self.register_buffer("cos_sin", self.rope_table(cfg, max_positions), persistent=False)

    @staticmethod
    def rope_table(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
        """(max_positions, D) fp32: cos in the first half, sin in the second."""
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), rope_inv_freq(cfg))
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def forward(self, input_ids, positions, ctx: Context, kv_cache: torch.Tensor, aux_layers: tuple[int, ...] = ()):
        """kv_cache: (num_layers, 2, num_blocks, block_size, Hkv, D). Returns the final
        hidden states (T, hidden); with aux_layers, also the residual stream after each
        of those layers (what an EAGLE-3 head reads), as a list of (T, hidden)."""
        x, residual = self.tp.embed(input_ids, self.embed_tokens.weight), None
        aux = []
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, ctx, kv_cache[i, 0], kv_cache[i, 1], self.cos_sin)
            if i in aux_layers:
                aux.append(x + residual)
        x, _ = self.norm(x, residual)
        return (x, aux) if aux_layers else x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied: the embedding is the head
            return self.tp.gather_vocab(torch.nn.functional.linear(hidden, self.embed_tokens.weight))
        return self.tp.gather_vocab(self.lm_head(hidden))  # a Linear, or a quantized copy (replica.model.quant)

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face-named tensors, fusing q/k/v and gate/up projections."""
        params = dict(self.named_parameters())
        fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                 "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        sizes = {"qkv_proj": [self.cfg.q_size, self.cfg.kv_size, self.cfg.kv_size],
                 "gate_up_proj": [self.cfg.intermediate_size] * 2}
        loaded = set()
        for name, w in weights.items():
            target = name.removeprefix("model.")
            for part, (fused_name, shard) in fused.items():
                if f".{part}." in target:
                    target = target.replace(part, fused_name)
                    p = params[target]
                    lo = sum(sizes[fused_name][:shard])
                    p[lo : lo + sizes[fused_name][shard]].copy_(w)
                    break
            else:
                if target not in params:
                    raise KeyError(f"unexpected weight {name!r} for {self.cfg.name}")
                p = params[target]
                if p.shape != w.shape:
                    raise ValueError(f"weight {name!r}: shape {tuple(w.shape)}, model expects {tuple(p.shape)}")
                p.copy_(w)
            loaded.add(target)
        missing = set(params) - loaded
        if missing:
            raise KeyError(f"missing weights: {sorted(missing)[:5]}")
