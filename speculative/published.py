"""EAGLE-3 heads as SpecForge trains them and SGLang and vLLM serve them, read as published.

A published head is a folder:

    config.json        architectures ["LlamaForCausalLMEagle3"]: a Llama config of the one decoder
                       layer (hidden_size, num_attention_heads, num_key_value_heads, head_dim?,
                       intermediate_size, rms_norm_eps, rope_theta, rope_scaling, max_position_embeddings),
                       vocab_size (the target's), draft_vocab_size, and optionally
                       eagle_config.eagle_aux_hidden_state_layer_ids
    model.safetensors  (or pytorch_model.bin) fc.weight (h, 3h), midlayer.{input_layernorm, hidden_norm,
                       post_attention_layernorm}.weight, midlayer.self_attn.{q,k,v,o}_proj.weight (q/k/v
                       over the 2h input), midlayer.mlp.{gate,up,down}_proj.weight, norm.weight,
                       lm_head.weight (draft_vocab, h), d2t (draft_vocab,) int64, t2d (vocab,) bool; and
                       embed_tokens.weight only in a head that does not share the target's embedding

The math and the tensor names are speculative.head's (its docstring: norm(emb) first in the
attention input, the fused feature as the layer's residual, the final norm after the MLP's
residual add). What differs, and is converted here once, at load:

  * d2t holds offsets: draft token d is target id d + d2t[d] (Eagle3Head.d2t holds the ids);
    t2d, the mask of those ids over the target vocabulary, is only checked against it.
  * eagle_config.eagle_aux_hidden_state_layer_ids are 0-based layer outputs, as SGLang reads them
    (it captures the input of layer id + 1): HeadConfig.aux_layers as they are. Absent, SGLang and
    vLLM both read the inputs of layers (2, L/2, L-3), i.e. outputs (1, L/2 - 1, L - 4).
    vLLM reads the same list as layer inputs (one lower); a top-level
    eagle_aux_hidden_state_layer_ids (vLLM's speculators layout) is refused rather than guessed.

The head rotates q/k with its own rope_theta and rope_scaling (absent theta: Llama's 10000, as
vLLM and SGLang read it; HeadConfig.rope_table), the target's table where they are the target's;
its head_dim must be the target's (its KV layer lives in the target's pool). Variants this head does not
compute (more layers, norm_before_residual, a hidden size of its own, biases, ...) are refused
by name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from replica.config import ModelConfig, RopeScaling
from replica.hf_checkpoint import _rope_scaling
from speculative.head import CONFIG_FILE, WEIGHTS_FILE, Eagle3Head, HeadConfig

ARCHITECTURE = "LlamaForCausalLMEagle3"
BIN_FILE = "pytorch_model.bin"
AUX_IDS = "eagle_aux_hidden_state_layer_ids"


def is_published(raw: dict) -> bool:
    """A config.json in the published layout (ours says "architecture": "eagle3")."""
    return "architectures" in raw


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """SGLang's and vLLM's feature layers without eagle_config: the inputs of (2, L/2, L-3)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def head_config(raw: dict, target: ModelConfig, file: Path) -> HeadConfig:
    """The HeadConfig of a published config.json, refusing what this head does not compute."""

    def refuse(field: str, why: str):
        raise ValueError(f"{file}: {field} {why}; not supported (published EAGLE-3 heads load as "
                         f"{ARCHITECTURE} with one decoder layer over the target's hidden size, rotary and vocabulary)")

    def need(key: str):
        if raw.get(key) is None:
            refuse(key, "is missing")
        return raw[key]

    if raw.get("architectures") != [ARCHITECTURE]:
        refuse("architectures", f"is {raw.get('architectures')!r}, not [{ARCHITECTURE!r}]")
    if raw.get("num_hidden_layers", 1) != 1:
        refuse("num_hidden_layers", f"is {raw['num_hidden_layers']} (one decoder layer here)")
    if raw.get("norm_before_residual"):
        refuse("norm_before_residual", "is true (the residual here is the fused feature before hidden_norm)")
    hidden = need("hidden_size")
    if hidden != target.hidden_size:
        refuse("hidden_size", f"is {hidden}, the target's is {target.hidden_size}")
    if raw.get("target_hidden_size") not in (None, target.hidden_size):
        refuse("target_hidden_size", f"is {raw['target_hidden_size']}, the target's is {target.hidden_size}")
    vocab = need("vocab_size")
    if vocab != target.vocab_size:
        refuse("vocab_size", f"is {vocab}, the target's is {target.vocab_size}")
    draft_vocab = raw.get("draft_vocab_size") or vocab  # absent: the whole vocabulary (as vLLM reads it)
    heads = need("num_attention_heads")
    kv_heads = raw.get("num_key_value_heads") or heads
    if heads % kv_heads:
        refuse("num_key_value_heads", f"{kv_heads} does not divide num_attention_heads {heads}")
    head_dim = raw.get("head_dim") or hidden // heads
    if head_dim != target.head_dim:
        refuse("head_dim", f"is {head_dim}, the target's rotary table is {target.head_dim} wide")
    theta = float(raw.get("rope_theta", 10000.0))  # absent: Llama's default, as vLLM and SGLang read it
    scaling = _rope_scaling(raw.get("rope_scaling"), file)  # refuses a kind it does not know, naming it
    own = (theta, scaling) != (target.rope_theta, target.rope_scaling)  # then the head rotates with its own table
    if raw.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"is {raw['hidden_act']!r}, not 'silu'")
    for flag in ("attention_bias", "mlp_bias", "tie_word_embeddings"):
        if raw.get(flag):
            refuse(flag, "is true")
    if raw.get("logit_scale", 1.0) != 1.0:
        refuse("logit_scale", f"is {raw['logit_scale']}")
    if AUX_IDS in raw:
        refuse(AUX_IDS, "is at the top level (vLLM's layer inputs); give 0-based layer outputs in "
                        f"eagle_config.{AUX_IDS}")
    eagle = raw.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state", True) is not True:
        refuse("eagle_config.use_aux_hidden_state", "is not true (the head reads three target layers)")
    ids = eagle.get(AUX_IDS)
    aux = tuple(ids) if ids else default_aux_layers(target.num_layers)
    if len(aux) != 3 or list(aux) != sorted(set(aux)) or aux[0] < 0 or aux[-1] >= target.num_layers:
        given = "" if ids else f" (absent: the default for {target.num_layers} layers)"
        refuse(f"eagle_config.{AUX_IDS}", f"is {list(aux)}{given}: three increasing layers of the target's "
                                           f"{target.num_layers} are needed")
    if not 0 < draft_vocab <= vocab:
        refuse("draft_vocab_size", f"is {draft_vocab}, not in [1, {vocab}]")
    return HeadConfig(target_name=target.name, hidden_size=hidden, intermediate_size=need("intermediate_size"),
                      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                      rms_norm_eps=float(need("rms_norm_eps")), target_vocab_size=vocab,
                      draft_vocab_size=draft_vocab, aux_layers=aux, rope_theta=theta if own else 0.0,
                      rope_scaling=raw.get("rope_scaling") if own else None)


def weights_file(folder: Path) -> Path:
    for name in (WEIGHTS_FILE, BIN_FILE):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"EAGLE-3 head at {folder}: neither {WEIGHTS_FILE} nor {BIN_FILE}")


def read_state(folder: Path, head: Eagle3Head) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The published tensors as `head`'s state dict (d2t converted to target ids), and the head's
    own embedding (None: it shares the target's). Refuses a missing, unknown or misshapen tensor."""
    file = weights_file(folder)
    if file.name == WEIGHTS_FILE:
        from safetensors.torch import load_file

        state = load_file(str(file))
    else:
        state = torch.load(file, map_location="cpu", weights_only=True)
    cfg = head.cfg
    embed = state.pop("embed_tokens.weight", None)
    if embed is not None and tuple(embed.shape) != (cfg.target_vocab_size, cfg.hidden_size):
        raise ValueError(f"{file}: embed_tokens.weight is {tuple(embed.shape)}, not "
                         f"({cfg.target_vocab_size}, {cfg.hidden_size})")
    offsets, t2d = state.pop("d2t", None), state.pop("t2d", None)
    state["d2t"] = target_ids(offsets, t2d, cfg, file)
    want = head.state_dict()
    if state.keys() != want.keys():
        missing, extra = sorted(want.keys() - state.keys()), sorted(state.keys() - want.keys())
        raise ValueError(f"{file}: tensors missing {missing}, not known {extra}")
    for name, t in state.items():
        if t.shape != want[name].shape:
            raise ValueError(f"{file}: {name} is {tuple(t.shape)}, not {tuple(want[name].shape)}")
    return state, embed


def target_ids(offsets: torch.Tensor | None, t2d: torch.Tensor | None, cfg: HeadConfig, file: Path) -> torch.Tensor:
    """(draft_vocab,) int64 target ids from d2t offsets (target id = draft id + d2t[draft id])."""
    draft, vocab = cfg.draft_vocab_size, cfg.target_vocab_size
    if offsets is None:
        if draft != vocab:
            raise ValueError(f"{file}: d2t is missing; a draft vocabulary of {draft} < {vocab} needs it")
        ids = torch.arange(draft)
    else:
        if offsets.shape != (draft,) or offsets.is_floating_point() or offsets.dtype == torch.bool:
            raise ValueError(f"{file}: d2t must be ({draft},) integer offsets, got {offsets.dtype} "
                             f"{tuple(offsets.shape)}")
        ids = torch.arange(draft) + offsets.long()
        if ids.min() < 0 or ids.max() >= vocab or len(ids.unique()) != draft:
            raise ValueError(f"{file}: d2t offsets give target ids outside [0, {vocab}) or repeated ones")
    if t2d is not None:
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[ids] = True
        if t2d.shape != (vocab,) or not torch.equal(t2d.bool(), mask):
            raise ValueError(f"{file}: t2d is not the mask of the target ids d2t gives")
    return ids


# -- writing one (a head trained here, for SGLang or vLLM) ---------------------------------


def rope_scaling_json(sc: RopeScaling | None) -> dict | None:
    if sc is None:
        return None
    if sc.rope_type == "linear":
        return {"rope_type": "linear", "factor": sc.factor}
    return {"rope_type": "llama3", "factor": sc.factor, "low_freq_factor": sc.low_freq_factor,
            "high_freq_factor": sc.high_freq_factor,
            "original_max_position_embeddings": sc.original_max_position_embeddings}


def save_published(head: Eagle3Head, target: ModelConfig, path: str | os.PathLike) -> Path:
    """Write `head` (for target `target`) in the published layout: config.json + model.safetensors,
    d2t as offsets and t2d beside it, the shared embedding not saved."""
    from safetensors.torch import save_file

    c = head.cfg
    c.check_target(target)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    ids = state.pop("d2t")
    state["d2t"] = ids - torch.arange(len(ids))  # offsets
    state["t2d"] = torch.zeros(c.target_vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    config = {
        "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
        "hidden_act": "silu", "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.target_vocab_size,
        "draft_vocab_size": c.draft_vocab_size, "max_position_embeddings": target.max_position_embeddings,
        **({"rope_theta": c.rope_theta, "rope_scaling": c.rope_scaling} if c.rope_theta else
           {"rope_theta": target.rope_theta, "rope_scaling": rope_scaling_json(target.rope_scaling)}),
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "torch_dtype": str(head.fc.weight.dtype).removeprefix("torch."),
        "eagle_config": {AUX_IDS: list(c.aux_layers), "use_aux_hidden_state": True},
    }
    tmp = path / (WEIGHTS_FILE + ".tmp")
    save_file(state, str(tmp))
    os.replace(tmp, path / WEIGHTS_FILE)
    (path / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return path
