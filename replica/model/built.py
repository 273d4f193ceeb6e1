"""A quantized CPU model as built, kept on disk so that a warm start maps it.

Building the default model on CPU reads the GGUF file twice (dense weights, then the
stored blocks), dequantizes every matrix, quantizes what is not stored and packs every
linear for the C++ GEMM: 3-5 s of a replica's start on 2 cores. The result depends only
on the file, the serving settings and the code that builds it, so the first start
writes the built model's tensors (packed weights, scales, the embedding, the norms) to
one safetensors file and the next start loads them instead (about 0.1 s).

    ~/.cache/edgechat/built/<key>.safetensors    (EDGECHAT_BUILT_DIR; "off" disables;
                                                  the newest 4 are kept)

Beside it, `<key>-<digest>.outliers.json` keeps the build's calibration for int8 prefill rows
(each matmul's outlier columns, `Runner.enable_narrow`): a ~0.3 s step over the calibration
chats that a warm start then skips, along with loading the tokenizer for them.

The key covers the resolved file (path, size, mtime), quantization, dtype, the kernel
set's packing and a digest of the source files that shape the tensors (this module,
the loader, the GGUF reader, the quantizer, the model, the GEMM's packing): a change to
any of them builds afresh. Only quantized single-rank CPU models with real weights are
kept; unquantized checkpoints load directly and GPU builds are not repacked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import msgspec
import torch
from torch import nn

from replica.config import EngineConfig, ModelConfig
from replica.hf_checkpoint import resolve_model
from replica.model.cpu_model import llama_of
from replica.model.llama import LlamaModel
from replica.model.quant import QLinear
from replica.presets import PRESETS

log = logging.getLogger("replica.model.built")
KEEP = 4  # the newest builds kept; older ones are removed

_SOURCES = [Path(__file__), *(Path(__file__).parent / f for f in ("loader.py", "quant.py", "llama.py", "runner.py")),
            Path(__file__).parents[1] / "gguf_file.py", Path(__file__).parents[2] / "kernels" / "qgemm_cpu.py",
            Path(__file__).parents[2] / "kernels" / "csrc" / "include" / "edgechat" / "qgemm.h"]


def folder() -> Path | None:
    v = os.environ.get("EDGECHAT_BUILT_DIR", "")
    if v == "off":
        return None
    return Path(v) if v else Path.home() / ".cache" / "edgechat" / "built"


def key(cfg: EngineConfig, ops) -> str | None:
    """The file name for this build, or None where builds are not kept."""
    if cfg.device != "cpu" or cfg.quantization == "none" or cfg.random_weights or cfg.tp != 1 or folder() is None:
        return None
    if cfg.model in PRESETS:
        return None
    path = Path(resolve_model(cfg.model))
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) + sorted(path.glob("*.json"))
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns};".encode())
    h.update(f"{cfg.quantization}:{cfg.dtype}:{ops.packed_qgemm};".encode())
    for src in _SOURCES:
        h.update(src.read_bytes())
    return h.hexdigest()[:32]


_CALIBRATION_SOURCES = [Path(__file__).parent / f for f in ("calibration.py", "cpu_model.py")] + [
    Path(__file__).parents[2] / "kernels" / "csrc" / "cpu_forward.cpp"]


def _outliers_path(cfg: EngineConfig, model_cfg: ModelConfig, ops) -> Path | None:
    k = key(cfg, ops)
    if k is None:
        return None
    h = hashlib.sha256(msgspec.json.encode(model_cfg))  # weights given for another model under this name
    for src in _CALIBRATION_SOURCES:
        h.update(src.read_bytes())
    return folder() / f"{k}-{h.hexdigest()[:16]}.outliers.json"


def kept_outliers(cfg: EngineConfig, model_cfg: ModelConfig, ops) -> list[list[int]] | None:
    """The kept calibration of this build (per matmul, its outlier columns), or None."""
    path = _outliers_path(cfg, model_cfg, ops)
    try:
        cols = json.loads(path.read_text()) if path is not None and path.is_file() else None
    except (OSError, ValueError) as e:
        log.warning("ignoring the kept calibration %s: %s", path, e)
        return None
    ok = isinstance(cols, list) and all(isinstance(c, list) and all(isinstance(i, int) for i in c) for c in cols)
    return cols if ok else None


def keep_outliers(cfg: EngineConfig, model_cfg: ModelConfig, ops, cols: list[list[int]]) -> None:
    """Keep a build's calibration where `kept_outliers` finds it (atomically; the newest KEEP)."""
    path = _outliers_path(cfg, model_cfg, ops)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(cols, f)
        os.replace(tmp, path)
        for old in sorted(path.parent.glob("*.outliers.json"), key=lambda f: f.stat().st_mtime)[:-KEEP]:
            old.unlink(missing_ok=True)
    except OSError as e:
        log.warning("could not keep the calibration in %s: %s", path.parent, e)


def _tensors(model: LlamaModel) -> dict[str, torch.Tensor]:
    return {name: t.detach().contiguous() for name, t in model.state_dict().items() if t is not None}


def keep(cfg: EngineConfig, model_cfg: ModelConfig, model: nn.Module) -> None:
    """Write a freshly built model (the LlamaModel inside a CpuModel) where `lookup` finds
    it, atomically; a failure to write only costs the next start its shortcut."""
    from safetensors.torch import save_file

    inner = llama_of(model)
    k = key(cfg, inner.ops)
    if k is None:
        return
    d = folder()
    try:
        d.mkdir(parents=True, exist_ok=True)
        qlinears = {name: [m.out_features, m.in_features, m.bits, m.bias is not None]
                    for name, m in inner.named_modules() if isinstance(m, QLinear)}
        meta = {"config": msgspec.json.encode(model_cfg).decode(), "qlinears": json.dumps(qlinears)}
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        os.close(fd)
        try:
            save_file(_tensors(inner), tmp, metadata=meta)
            os.replace(tmp, d / f"{k}.safetensors")
            for old in sorted(d.glob("*.safetensors"), key=lambda f: f.stat().st_mtime)[:-KEEP]:
                old.unlink(missing_ok=True)  # builds of files or code since replaced
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        log.warning("could not keep the built model in %s: %s", d, e)


def lookup(cfg: EngineConfig, ops, max_positions: int | None = None) -> tuple[ModelConfig, LlamaModel] | None:
    """(model config, the kept build as a LlamaModel over the file's tensors), or None
    when there is none (or it does not match what this code builds: then the caller
    builds afresh and keeps that)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_file

    k = key(cfg, ops)
    path = folder() / f"{k}.safetensors" if k else None
    if path is None or not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        model_cfg = msgspec.json.decode(meta["config"], type=ModelConfig)
        qlinears = json.loads(meta["qlinears"])
        tensors = load_file(str(path))
    except (OSError, KeyError, ValueError, RuntimeError, SafetensorError, msgspec.DecodeError) as e:
        log.warning("ignoring the kept build %s: %s", path, e)
        return None
    mpe = model_cfg.max_position_embeddings
    max_positions = min(max_positions or cfg.max_model_len or mpe, mpe)
    with torch.device("meta"):
        model = LlamaModel(model_cfg, ops, max_positions, None)
        for name, (out_f, in_f, bits, bias) in qlinears.items():
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, QLinear.shell(out_f, in_f, bits, bias))
    expected = set(model.state_dict()) | {f"{n}.{b}" for n in qlinears for b in ("qs", "d", "m")}
    if set(tensors) - {f"{n}.packed" for n in qlinears} != expected:
        log.warning("ignoring the kept build %s: its tensors do not match the model", path)
        return None
    for name, t in tensors.items():
        parent, _, attr = name.rpartition(".")
        mod = model.get_submodule(parent)
        if attr in mod._parameters:
            mod._parameters[attr] = nn.Parameter(t, requires_grad=False)
        else:
            mod._buffers[attr] = t
    model.cos_sin = LlamaModel.rope_table(model_cfg, max_positions)
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        log.warning("ignoring the kept build %s: it leaves tensors unfilled", path)
        return None
    return model_cfg, model.eval()
