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
from dataclasses import dataclass
from pathlib import Path

import torch

from replica.config import EngineConfig, ModelConfig
from replica.gguf_file import GGUFFile
from replica.hf_checkpoint import ModelNotFoundError, config_from_hf, model_config, resolve_model, safetensors_files
from replica.model.quant import GGUF_TYPES, QWeight, from_gguf
from replica.presets import PRESETS
from replica.tokenizer import Tokenizer

__all__ = ["Checkpoint", "CheckpointError", "ModelNotFoundError", "PRESETS", "load_checkpoint", "load_config",
           "load_gguf_quantized", "load_model_for", "prepare_process", "random_weights", "resolve_model", "unpermute_qk", "weight_shapes"]


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
    if spec in PRESETS:
        raise ModelNotFoundError(f"{spec!r} is a shape preset without weights: use "
                                 f"random_weights(PRESETS[{spec!r}]), or pass a model file, folder or hub id")
    path = resolve_model(spec)
    if path.endswith(".gguf"):
        gf = GGUFFile(path)
        config = gf.model_config()
        return Checkpoint(config, _load_gguf(gf, config, dtype), Tokenizer.from_gguf(path), path)
    config = config_from_hf(path)
    return Checkpoint(config, _load_safetensors(Path(path), config, dtype), Tokenizer.from_hf_dir(path), path)


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


def _load_gguf(gf: GGUFFile, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
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
    weights = {}
    for name in expected:
        w = gf.dequantize(names[name])
        if ".q_proj." in name:
            w = unpermute_qk(w, config.num_heads)
        elif ".k_proj." in name:
            w = unpermute_qk(w, config.num_kv_heads)
        weights[name] = torch.from_numpy(w).to(dtype).contiguous()
    return weights


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


def _load_safetensors(folder: Path, config: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    expected = weight_shapes(config)
    where = safetensors_files(folder)  # name -> file from the shard index, if any
    files = sorted(set(where.values())) if where else sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has no *.safetensors files")
    found: dict[str, Path] = {}
    weights = {}
    for file in files:
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
                weights[name] = f.get_tensor(name).to(dtype).contiguous()
    missing = [n for n in expected if n not in found]
    if missing:
        listed = {n: where[n] for n in missing if n in where}
        if listed:
            name, file = next(iter(listed.items()))
            raise CheckpointError(f"tensor {name} missing from {file} (listed there by model.safetensors.index.json)"
                                  + _more(len(missing)))
        raise CheckpointError(f"tensor {missing[0]} missing from {', '.join(str(f) for f in files)}"
                              + _more(len(missing)))
    return {n: weights[n] for n in expected}


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


def load_model_for(cfg: EngineConfig):
    """(ModelConfig, Hugging Face-named weights) for this engine config."""
    prepare_process(cfg)
    dtype = getattr(torch, cfg.dtype) if cfg.quantization == "none" else torch.float32  # quantized from fp32
    if cfg.random_weights:
        model_cfg = load_config(cfg.model)
        # drawn where they will live: 8B bf16 values drawn on a CPU took 4 minutes of a replica's start
        return model_cfg, random_weights(model_cfg, dtype=dtype, seed=cfg.seed, device=cfg.device)
    ckpt = load_checkpoint(cfg.model, dtype=dtype)
    return ckpt.config, ckpt.weights
