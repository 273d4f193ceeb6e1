"""EAGLE-3 draft head (Li et al., "EAGLE-3: Scaling up Inference Acceleration of
Large Language Models via Training-Time Test", arXiv 2503.01840).

The head guesses the target's next tokens from the target's own features. The
entry at position p pairs token x_p with a feature g of the prefix x_<p:

    g = fc([a_lo ; a_mid ; a_hi])          # target residual streams at position p-1, 3h -> h
                                           # (deeper draft steps: the head's own previous output o)
    z = [RMSNorm(E x_p) ; RMSNorm(g)]      # (2h): the decoder layer's attention input
    u = g + Attn(z)                        # one Llama decoder layer, attending to the head's KV
    o = u + MLP(RMSNorm(u))                # o is the next draft step's g
    q(x_{p+1}) = softmax(lm_head(RMSNorm(o)))   # over the draft vocabulary; d2t maps to target ids

E is the target's embedding, shared and frozen. Position 0 has no prefix: its
feature is zeros (fc has no bias, so g = 0). Pairing x_p with a_{p-1} makes the
head's KV at p a function of x_<=p only, so it lives in the same paged slots as
the target's KV and is as shareable as a prefix-cached block.

Feature layers: the paper reads layers (2, L/2, L-3); `aux_layers_for` takes the
0-based residual-stream outputs (1, L/2 - 1, L - 4), i.e. the inputs of those
layers -- low, middle and high features (SmolLM2-135M, L = 30: 1, 14, 26).

The attention pattern belongs to the caller: `forward` takes `attend(q, k, v)`
(the paged cache at inference, the training-time-test mask in training).
Weights use the names of the published EAGLE-3 heads (fc, midlayer.*, norm,
lm_head); `d2t` here holds target ids, not offsets. `load_head` reads this
package's own files (config.json "architecture": "eagle3" + model.safetensors) and
heads published by SpecForge/SGLang/vLLM (speculative/published.py), whose d2t
offsets it turns into ids once, at load.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from replica.config import ModelConfig

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def aux_layers_for(num_layers: int) -> tuple[int, int, int]:
    """0-based target layers whose outputs the head reads (see the module docstring)."""
    if num_layers >= 8:
        return (1, num_layers // 2 - 1, num_layers - 4)
    if num_layers < 3:
        raise ValueError(f"an EAGLE-3 head reads three distinct target layers; the target has {num_layers}")
    return (0, num_layers // 2, num_layers - 1)


@dataclass(frozen=True)
class HeadConfig:
    target_name: str
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    target_vocab_size: int
    draft_vocab_size: int
    aux_layers: tuple[int, int, int]
    # The head's own rotary where it is not the target's (a published head trained with another
    # rope_theta or scaling, speculative.published): theta 0 = the target's table.
    rope_theta: float = 0.0
    rope_scaling: dict | None = None  # Hugging Face's rope_scaling, with rope_theta

    def __post_init__(self):
        object.__setattr__(self, "aux_layers", tuple(self.aux_layers))
        if len(set(self.aux_layers)) != 3 or list(self.aux_layers) != sorted(self.aux_layers):
            raise ValueError(f"aux_layers must be three increasing layer indices, got {self.aux_layers}")
        if not 0 < self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, {self.target_vocab_size}], got {self.draft_vocab_size}")
        assert self.num_heads % self.num_kv_heads == 0 and self.head_dim % 2 == 0

    @classmethod
    def for_target(cls, cfg: ModelConfig, draft_vocab_size: int, intermediate_size: int = 0) -> HeadConfig:
        return cls(target_name=cfg.name, hidden_size=cfg.hidden_size,
                   intermediate_size=intermediate_size or cfg.intermediate_size, num_heads=cfg.num_heads,
                   num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                   target_vocab_size=cfg.vocab_size, draft_vocab_size=min(draft_vocab_size, cfg.vocab_size),
                   aux_layers=aux_layers_for(cfg.num_layers))

    def rope_table(self, target: ModelConfig, max_positions: int) -> torch.Tensor | None:
        """(max_positions, head_dim) [cos | sin] of the head's own rotary, or None where it is
        the target's (the drafter then shares the target's table)."""
        if not self.rope_theta:
            return None
        from replica.hf_checkpoint import _rope_scaling
        from replica.model.llama import LlamaModel

        own = replace(target, rope_theta=self.rope_theta, rope_scaling=_rope_scaling(self.rope_scaling, "the head"),
                      head_dim=self.head_dim)
        if (own.rope_theta, own.rope_scaling) == (target.rope_theta, target.rope_scaling):
            return None
        return LlamaModel.rope_table(own, max_positions)

    def check_target(self, cfg: ModelConfig) -> None:
        """Raise if a head with this config cannot draft for target `cfg`."""
        ok = (self.hidden_size == cfg.hidden_size and self.target_vocab_size == cfg.vocab_size
              and max(self.aux_layers) < cfg.num_layers)
        if not ok:
            raise ValueError(f"EAGLE-3 head for {self.target_name!r} (hidden {self.hidden_size}, vocab "
                             f"{self.target_vocab_size}, layers {self.aux_layers}) does not fit target {cfg.name!r} "
                             f"(hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, {cfg.num_layers} layers); "
                             "retrain it with `python -m speculative.train`")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rotate(x, cos, sin):
    """Rotate-half RoPE, out of place (training backpropagates through it)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Attention(nn.Module):
    """GQA over the 2h-wide input z; q/k rotated at the entry's position."""

    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.cfg = cfg
        h2 = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(h2, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(h2, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(h2, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, z, positions, cos_sin, attend: Attend):
        c = self.cfg
        q = self.q_proj(z).unflatten(-1, (c.num_heads, c.head_dim))  # (..., H, D)
        k = self.k_proj(z).unflatten(-1, (c.num_kv_heads, c.head_dim))  # (..., Hkv, D)
        v = self.v_proj(z).unflatten(-1, (c.num_kv_heads, c.head_dim))
        cs = cos_sin[positions].unsqueeze(-2).to(q.dtype)  # (..., 1, D): [cos | sin], in the head's dtype
        cos, sin = cs.chunk(2, dim=-1)
        o = attend(rotate(q, cos, sin), rotate(k, cos, sin), v)  # (..., H, D)
        return self.o_proj(o.flatten(-2))


class MLP(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: HeadConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # token embedding
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)  # fused feature
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, emb, g, positions, cos_sin, attend: Attend):
        z = torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], dim=-1)  # (..., 2h)
        u = g + self.self_attn(z, positions, cos_sin, attend)
        return u + self.mlp(self.post_attention_layernorm(u))


class Eagle3Head(nn.Module):
    def __init__(self, cfg: HeadConfig, embed_weight: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = DecoderLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size, device=embed_weight.device))
        # The target's embedding: shared storage, no gradient, never saved with the head.
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """(..., 3h) target features [lo ; mid ; hi] -> (..., h)."""
        return self.fc(aux.to(self.fc.weight.dtype))

    def forward(self, tokens, g, positions, cos_sin, attend: Attend):
        """tokens (...,) target ids; g (..., h); positions (...,) -> o (..., h)."""
        emb = F.embedding(tokens, self.embed_weight).to(g.dtype)
        return self.midlayer(emb, g, positions, cos_sin, attend)

    def logits(self, o: torch.Tensor) -> torch.Tensor:
        """(..., h) -> (..., draft_vocab) logits; token d is target id d2t[d]."""
        return self.lm_head(self.norm(o))

    def kv_shape(self) -> tuple[int, int]:
        return self.cfg.num_kv_heads, self.cfg.head_dim


# -- files ---------------------------------------------------------------------------------


def save_head(head: Eagle3Head, path: str | os.PathLike) -> Path:
    """config.json + model.safetensors (the shared embedding is not saved)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = asdict(head.cfg) | {"architecture": "eagle3"}
    tmp = path / (WEIGHTS_FILE + ".tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}, str(tmp))
    os.replace(tmp, path / WEIGHTS_FILE)  # never leave a half-written head behind
    (path / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def read_config(path: Path) -> tuple[dict, Path]:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no EAGLE-3 head at {path} (missing {CONFIG_FILE}); train one with "
                                "`python -m speculative.train`")
    return json.loads(file.read_text()), file


def load_head_config(path: str | os.PathLike) -> HeadConfig:
    """The config of a head in this package's own format."""
    raw, file = read_config(Path(path))
    if raw.pop("architecture", None) != "eagle3":
        raise ValueError(f"{file} is not an EAGLE-3 head config")
    return HeadConfig(**raw)
