"""Where trained heads live, without torch (the launcher and the replica CLI ask).

One folder per target model under $EDGECHAT_EAGLE3_DIR, else
~/.cache/edgechat/eagle3: config.json + model.safetensors (the head; or a published head,
speculative/published.py, whose weights may be pytorch_model.bin), policy.json
(the measured draft shape per batch size), data.pt and train_state.pt (training).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

TRAIN_HINT = "python -m speculative.train (about 30 minutes on 2 CPU cores)"


def head_dir(model_name: str, root: str | os.PathLike | None = None) -> Path:
    """Where the head for `model_name` lives: root, else $EDGECHAT_EAGLE3_DIR, else
    ~/.cache/edgechat/eagle3, then one folder per target model."""
    base = root or os.environ.get("EDGECHAT_EAGLE3_DIR") or Path.home() / ".cache" / "edgechat" / "eagle3"
    return Path(base) / re.sub(r"[^A-Za-z0-9._-]", "_", model_name)


def has_head(folder: str | os.PathLike) -> bool:
    """A head's files are there: ours, or a published one (whose weights may be pytorch_model.bin)."""
    folder = Path(folder)
    return (folder / "config.json").is_file() and any(
        (folder / name).is_file() for name in ("model.safetensors", "pytorch_model.bin"))


def model_name(spec: str) -> str:
    """The name heads are filed under for a model spec (what ModelConfig.name says)."""
    from replica.hf_checkpoint import model_config

    return model_config(spec).name
