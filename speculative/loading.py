"""Loading an EAGLE-3 head from a folder, whichever layout it is in: this package's own
(speculative.head) or the one SpecForge, SGLang and vLLM publish (speculative.published).
It imports both; neither imports it."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from replica.config import ModelConfig
from speculative import published
from speculative.head import WEIGHTS_FILE, Eagle3Head, load_head_config, read_config


def load_head(path: str | os.PathLike, target_cfg: ModelConfig, embed_weight: torch.Tensor,
              dtype: torch.dtype | None = None) -> Eagle3Head:
    """The head saved at `path` (our format, or a published one: speculative.published), on
    embed_weight's device, checked against the target."""
    from safetensors.torch import load_file

    path = Path(path)
    raw, file = read_config(path)
    own_embed, pub = None, published.is_published(raw)
    cfg = published.head_config(raw, target_cfg, file) if pub else load_head_config(path)
    cfg.check_target(target_cfg)
    with torch.device(embed_weight.device):  # built where it runs (it was built on the CPU and stayed there)
        head = Eagle3Head(cfg, embed_weight)
    if pub:
        state, own_embed = published.read_state(path, head)
    else:
        state = load_file(str(path / WEIGHTS_FILE), device=str(embed_weight.device))
    head.load_state_dict(state, strict=True)
    if own_embed is not None:  # a head that carries an embedding of its own drafts with it
        own_embed = own_embed.to(embed_weight.device, embed_weight.dtype)
        if not torch.equal(own_embed, embed_weight):  # a copy of the target's is shared, not held twice
            head.embed_weight = own_embed
    return head.to(dtype or embed_weight.dtype).eval()
