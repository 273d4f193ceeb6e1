"""Weights in Hugging Face Llama names, from a GGUF file or a safetensors folder.

    model.embed_tokens.weight                               (V, H)
    model.layers.{i}.input_layernorm.weight                 (H,)
    model.layers.{i}.self_attn.q_proj.weight                (Nq*D, H)   (+ .bias: Qwen2)
    model.layers.{i}.self_attn.{k,v}_proj.weight            (Nkv*D, H)  (+ .bias: Qwen2)
    model.layers.{i}.self_attn.o_proj.weight                (H, Nq*D)
    model.layers.{i}.post_attention_layernorm.weight        (H,)
    model.layers.{i}.mlp.{gate,up}_proj.weight              (I, H)
    model.layers.{i}.mlp.down_proj.weight                   (H, I)
    model.norm.weight                                       (H,)
    lm_head.weight                                          (V, H)      (absent when tied)

Q and K rows are in Hugging Face's rotate-half RoPE order; GGUF files from
llama.cpp's converter store them interleaved, and `unpermute_qk` undoes that.
Spec resolution and config.json parsing live in the torch-free
`replica.hf_checkpoint` (the proxy needs them too); they are re-exported here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from replica.config import EngineConfig, ModelConfig
from replica.gguf_file import GGUFFile
from replica.hf_checkpoint import ModelNotFoundError, config_from_hf, model_config, resolve_model, safetensors_files
from replica.model.quant import GGUF_TYPES, QWeight, from_gguf
from replica.model.tp import shard_range
from replica.presets import PRESETS
from replica.tokenizer import Tokenizer

__all__ = ["Checkpoint", "CheckpointError", "ModelNotFoundError", "PRESETS", "Weights", "load_checkpoint", "load_config",
           "load_gguf_quantized", "load_model_for", "open_weights", "prepare_process", "random_weights", "resolve_model",
           "unpermute_qk", "weight_shapes"]


@dataclass
class Checkpoint:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face Llama names, on CPU, in the requested dtype
    tokenizer: Tokenizer
    source: str  # resolved path


class CheckpointError(ValueError):
    """Weights that do not match their config: the message names the tensor and the file."""


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint for `config` holds, with its shape, in a fixed order."""
    H, I, V = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.q_size, config.kv_size
    shapes = {"model.embed_tokens.weight": (V, H)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[p + f"self_attn.{proj}.weight"] = (rows, H)
            if config.attention_bias:
                shapes[p + f"self_attn.{proj}.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (H, q)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        shapes[p + "mlp.gate_proj.weight"] = (I, H)
        shapes[p + "mlp.up_proj.weight"] = (I, H)
        shapes[p + "mlp.down_proj.weight"] = (H, I)
    shapes["model.norm.weight"] = (H,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def load_config(spec: str) -> ModelConfig:
    """Config only, no tensors: a PRESETS name, "default", a .gguf, a folder or a hub id."""
    return PRESETS[spec] if spec in PRESETS else model_config(spec)


def load_checkpoint(spec: str, dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Every tensor read at once, each in memory of its own (an engine reads them one at a
    time instead: `load_model_for`)."""
    config, weights, path = open_weights(spec, dtype, copy=True)
    tokenizer = Tokenizer.from_gguf(path) if path.endswith(".gguf") else Tokenizer.from_hf_dir(path)
    return Checkpoint(config, dict(weights.items()), tokenizer, path)


Read = Callable[[str, tuple[int, int, int] | None], tuple[torch.Tensor, int]]  # (name, part) -> (tensor, stored bytes)


class Weights(Mapping):
    """A checkpoint's tensors by Hugging Face name, each read from its file when asked for:
    this rank's slice only (`replica.model.tp.shard_range`; rank 0 of 1 takes all of it),
    in `dtype`, on `device`. Nothing is kept between reads, so a process never holds more
    of the files than the tensors it is copying: a safetensors slice is a view of the
    file's pages (mapped for that read, unmapped when the view goes; returned as it is
    where dtype and device already match, else converted), a GGUF slice is decoded from
    its own bytes. `bytes_read`: stored bytes taken from the files so far."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], read: Read, dtype: torch.dtype,
                 device: str | torch.device = "cpu", rank: int = 0, world: int = 1, copy: bool = False):
        self.shapes, self._read = shapes, read  # full shapes, in weight_shapes' order
        self.dtype, self.device, self.rank, self.world, self.copy = dtype, torch.device(device), rank, world, copy
        self.bytes_read = 0

    def __getitem__(self, name: str) -> torch.Tensor:
        w, stored = self._read(name, shard_range(name, self.shapes[name], self.rank, self.world))
        self.bytes_read += stored
        w = w.to(device=self.device, dtype=self.dtype, copy=self.copy)
        return w.contiguous() if self.copy else w

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)

    def __contains__(self, name) -> bool:  # Mapping's would read the tensor
        return name in self.shapes


def open_weights(spec: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", rank: int = 0,
                 world: int = 1, copy: bool = False) -> tuple[ModelConfig, Weights, str]:
    """(config, its `Weights` for `rank` of `world`, resolved path). Every tensor's name and
    shape is checked against the config here, before any is read."""
    if spec in PRESETS:
        raise ModelNotFoundError(f"{spec!r} is a shape preset without weights: use "
                                 f"random_weights(PRESETS[{spec!r}]), or pass a model file, folder or hub id")
    path = resolve_model(spec)
    if path.endswith(".gguf"):
        gf = GGUFFile(path)
        config = gf.model_config()
        read = _gguf_reader(gf, config)
    else:
        config = config_from_hf(path)
        read = _safetensors_reader(Path(path), config)
    return config, Weights(weight_shapes(config), read, dtype, device, rank, world, copy), path


def random_weights(config: ModelConfig, dtype: torch.dtype = torch.float32, seed: int = 0,
                   device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Same names and shapes as a real checkpoint, N(0, 0.02) matrices and biases, unit
    norms; deterministic in `seed`. For timing and tests without downloads."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            weights[name] = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen)
    return weights


def unpermute_qk(w, n_head: int):
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> rotate-half halves).

    The converter maps each head's rows [first half | second half] to interleaved pairs:
    w.reshape(n_head, 2, R//n_head//2, C).swapaxes(1, 2); this swaps those axes back.
    Works on numpy arrays and torch tensors, 2-D weights and 1-D biases.
    """
    shape = w.shape
    rows = shape[0]
    w = w.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2)  # (heads, 2, D/2, cols)
    return w.reshape(shape)


# -- GGUF -------------------------------------------------------------------------------

_GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
_GGUF_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
_GGUF_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    m = _GGUF_BLOCK_NAME.fullmatch(name)
    if m and m.group(2) in _GGUF_BLOCK:
        return f"model.layers.{m.group(1)}.{_GGUF_BLOCK[m.group(2)]}.{m.group(3)}"
    return None


def _gguf_reader(gf: GGUFFile, config: ModelConfig) -> Read:
    expected = weight_shapes(config)
    names = {}  # HF name -> GGUF name
    for gname, info in gf.tensors.items():
        name = gguf_to_hf_name(gname)
        if name is None or name not in expected:
            raise CheckpointError(f"unexpected tensor {gname} in {gf.path} (not part of a {config.num_layers}-layer "
                                  "Llama layout)")
        if info.shape != expected[name]:
            raise CheckpointError(f"tensor {gname} ({name}) in {gf.path} has shape {info.shape}, "
                                  f"expected {expected[name]}")
        names[name] = gname
    _check_complete(expected, names, gf.path)

    def read(name: str, part: tuple[int, int, int] | None) -> tuple[torch.Tensor, int]:
        info = gf.tensors[names[name]]
        w = gf.dequantize(names[name], part)  # only the slice's blocks
        heads = config.num_heads if ".q_proj." in name else config.num_kv_heads if ".k_proj." in name else 0
        if heads:  # permuted within each head, so a slice of whole heads un-permutes alone
            w = unpermute_qk(w, heads * w.shape[0] // info.shape[0])
        stored = info.nbytes if part is None else info.nbytes // info.shape[part[0]] * (part[2] - part[1])
        return torch.from_numpy(w), stored

    return read


def load_gguf_quantized(path: str, config: ModelConfig) -> dict:
    """The file's Q4_0 / Q4_1 / Q8_0 matrices as `replica.model.quant.QWeight`s by Hugging
    Face name, exactly as stored (Q/K rows un-permuted like the dense weights)."""
    gf = GGUFFile(path)
    out = {}
    for gname, info in gf.tensors.items():
        name = gguf_to_hf_name(gname)
        if name is None or info.qtype.name not in GGUF_TYPES or len(info.shape) != 2:
            continue
        w = from_gguf(gf.raw(gname), info.qtype.name)
        heads = config.num_heads if ".q_proj." in name else config.num_kv_heads if ".k_proj." in name else 0
        if heads:
            w = QWeight(*(unpermute_qk(t, heads).contiguous() for t in (w.qs, w.d, w.m)), w.bits)
        out[name] = w
    return out


# -- safetensors ----------------------------------------------------------------------


def _safetensors_reader(folder: Path, config: ModelConfig) -> Read:
    from safetensors import safe_open

    expected = weight_shapes(config)
    where = safetensors_files(folder)  # name -> file from the shard index, if any
    files = sorted(set(where.values())) if where else sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors files")
    found: dict[str, Path] = {}
    for file in files:  # headers only
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):
                    continue  # recomputed from the config
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue  # tied: the embedding is the head
                if name not in expected:
                    raise CheckpointError(f"unexpected tensor {name} in {file}")
                if where and where.get(name) != file:
                    raise CheckpointError(f"tensor {name} is in {file} but the shard index puts it in "
                                          f"{where.get(name)}")
                shape = tuple(f.get_slice(name).get_shape())
                if shape != expected[name]:
                    raise CheckpointError(f"tensor {name} in {file} has shape {shape}, expected {expected[name]}")
                found[name] = file
    missing = [n for n in expected if n not in found]
    if missing:
        listed = {n: where[n] for n in missing if n in where}
        if listed:
            name, file = next(iter(listed.items()))
            raise CheckpointError(f"tensor {name} missing from {file} (listed there by model.safetensors.index.json)"
                                  + _more(len(missing)))
        raise CheckpointError(f"tensor {missing[0]} missing from {', '.join(str(f) for f in files)}"
                              + _more(len(missing)))

    def read(name: str, part: tuple[int, int, int] | None) -> tuple[torch.Tensor, int]:
        # get_slice(...)[...] is a view of the mapped file: only the slice's pages are read. The
        # file is mapped for this one read (the view keeps it so), not for the whole load.
        with safe_open(str(found[name]), framework="pt") as f:
            s = f.get_slice(name)
            if part is None:
                w = s[:]
            else:
                dim, lo, hi = part
                w = s[lo:hi] if dim == 0 else s[:, lo:hi]
        return w, w.numel() * w.element_size()

    return read


def _check_complete(expected: dict, found: dict, source: str) -> None:
    missing = [n for n in expected if n not in found]
    if missing:
        raise CheckpointError(f"tensor {missing[0]} missing from {source}" + _more(len(missing)))


def _more(n_missing: int) -> str:
    return f" (and {n_missing - 1} more)" if n_missing > 1 else ""


def prepare_process(cfg: EngineConfig) -> None:
    """The engine process's torch settings: its seed and, on CPU, its threads."""
    torch.manual_seed(cfg.seed)
    if cfg.device == "cpu":
        # torch's OpenMP pool spins between ops: leave the API process a core. The C++ step (replica.model.cpu_model)
        # has its own pool over every core, whose helpers yield instead (kernels/csrc/include/edgechat/pool.h).
        torch.set_num_threads(cfg.cpu_threads or max(1, (os.cpu_count() or 2) - 1))


def load_model_for(cfg: EngineConfig, rank: int = 0):
    """(ModelConfig, Hugging Face-named weights) for rank `rank` of this engine config: a
    `Weights` that reads only this rank's shard (of cfg.tp), tensor by tensor, onto
    cfg.device (the Runner copies each into the model as it comes); random weights are
    drawn whole, where they will live."""
    prepare_process(cfg)
    dtype = getattr(torch, cfg.dtype) if cfg.quantization == "none" else torch.float32  # quantized from fp32
    if cfg.random_weights:
        model_cfg = load_config(cfg.model)
        # drawn where they will live: 8B bf16 values drawn on a CPU took 4 minutes of a replica's start
        return model_cfg, random_weights(model_cfg, dtype=dtype, seed=cfg.seed, device=cfg.device)
    model_cfg, weights, _ = open_weights(cfg.model, dtype, cfg.device, rank, cfg.tp)
    return model_cfg, weights
