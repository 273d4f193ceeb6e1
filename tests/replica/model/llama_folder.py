"""A Llama-shaped Hugging Face folder with random weights, for loading tests that need
real bytes on disk: config.json, two safetensors files and their index, and the tiny
byte-level tokenizer (tests/replica/tiny.py; a quantized engine calibrates on text)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from replica.hf_checkpoint import config_from_hf
from replica.model.loader import weight_shapes
from tests.replica.tiny import tiny_tokenizer

# ~300 MB in fp32 (74M values): a size at which a process's peak RSS tells whole-checkpoint
# copies from shards above the interpreter's noise, and small enough for 2 busy cores.
MEDIUM = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 8192, "hidden_size": 1024,
          "intermediate_size": 2816, "num_hidden_layers": 5, "num_attention_heads": 8, "num_key_value_heads": 4,
          "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
          "tie_word_embeddings": False, "eos_token_id": 0, "bos_token_id": 1}


def write_llama_folder(folder: Path, hf_config: dict = MEDIUM, seed: int = 0) -> int:
    """Write the folder; returns the checkpoint's tensor bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf_config))
    tiny_tokenizer().backend.save(str(folder / "tokenizer.json"))
    shapes = weight_shapes(config_from_hf(folder))
    names = list(shapes)
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for k, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        tensors = {n: torch.ones(shapes[n]) if n.endswith("norm.weight") else
                   torch.randn(shapes[n], generator=gen) * 0.02 for n in part}
        save_file(tensors, str(folder / file))
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return total
