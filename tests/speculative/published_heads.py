"""EAGLE-3 heads in the published layout (SpecForge/SGLang/vLLM) for the default model's shape,
shared by tests/speculative/test_published.py and tests/replica/test_published_head.py: a head of
our own format, the same head written as published (speculative.published.save_published), and
that folder edited field by field or tensor by tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from replica.config import ModelConfig
from speculative.head import Eagle3Head, HeadConfig
from speculative.published import save_published


def own_head(target: ModelConfig, embed: torch.Tensor, draft_ids: torch.Tensor, seed: int = 0) -> Eagle3Head:
    """A random head over the target ids `draft_ids` (draft token d is target id draft_ids[d]); weights
    larger than nn.Linear's init, so attention and norms matter to what it drafts."""
    cfg = HeadConfig.for_target(target, len(draft_ids))
    torch.manual_seed(seed)
    head = Eagle3Head(cfg, embed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(1 + 2 * torch.rand(p.shape, generator=g))
            if p.dim() == 1:  # norms: not all ones
                p.add_(0.5 * torch.randn(p.shape, generator=g))
        head.d2t.copy_(draft_ids)
    return head.eval()


def write_published(head: Eagle3Head, target: ModelConfig, path: Path, config: dict | None = None,
                    drop: tuple[str, ...] = (), tensors: dict[str, torch.Tensor] | None = None,
                    bin_file: bool = False) -> Path:
    """`head` in the published layout at `path`, then edited: config.json as `edit_config` does, the
    tensors named in `drop` removed, `tensors` set, and with `bin_file` the weights as
    pytorch_model.bin (torch.save) instead of model.safetensors."""
    save_published(head, target, path)
    edit_config(path, config or {})
    if tensors or drop or bin_file:
        from safetensors.torch import load_file, save_file

        weights = path / "model.safetensors"
        state = {k: v for k, v in load_file(str(weights)).items() if k not in drop} | (tensors or {})
        weights.unlink()
        if bin_file:
            torch.save(state, path / "pytorch_model.bin")
        else:
            save_file(state, str(weights))
    return path


def edit_config(path: Path, config: dict) -> None:
    """Set config.json keys from `config`: a value of None removes the key, "eagle_config.X" is X
    inside eagle_config."""
    file = path / "config.json"
    raw = json.loads(file.read_text())
    for key, value in config.items():
        where, name = raw, key
        if key.startswith("eagle_config."):
            where, name = raw.setdefault("eagle_config", {}), key.removeprefix("eagle_config.")
        if value is None:
            where.pop(name, None)
        else:
            where[name] = value
    file.write_text(json.dumps(raw, indent=2) + "\n")


def config_variant(src: Path, dst: Path, config: dict) -> Path:
    """A folder with src's weights (linked, not copied) and its config.json edited."""
    dst.mkdir(parents=True)
    shutil.copy(src / "config.json", dst / "config.json")
    (dst / "model.safetensors").symlink_to(src / "model.safetensors")
    edit_config(dst, config)
    return dst
