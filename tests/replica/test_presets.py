"""Shape presets served with random weights: each preset's folder (replica.presets) reads
back as the preset, and its tokenizer spans exactly the preset's vocabulary, so any id a
random model samples decodes to text and BOS/EOS are the preset's own. Torch-free."""

import dataclasses
import subprocess
import sys

import pytest

from replica.hf_checkpoint import ModelNotFoundError, model_config, resolve_model
from replica.presets import PRESETS, preset_dir
from replica.tokenizer import Tokenizer


@pytest.fixture(autouse=True)
def presets_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGECHAT_PRESETS_DIR", str(tmp_path))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_a_preset_folder_reads_back_as_the_preset(name):
    cfg = model_config(name)  # through resolve_model(config_only=True): the folder's config.json
    assert cfg == dataclasses.replace(PRESETS[name], name=cfg.name)
    tok = Tokenizer.from_spec(name)
    assert tok.vocab_size == cfg.vocab_size
    assert set(tok.eos_token_ids) >= set(cfg.eos_token_ids) and tok.bos_token_id == cfg.bos_token_id
    specials = {i for i in range(cfg.vocab_size - 8, cfg.vocab_size) if tok.backend.id_to_token(i).startswith("<|")}
    words = [i for i in (300, cfg.vocab_size // 2, cfg.vocab_size - 1) if i not in specials
             and i not in cfg.eos_token_ids and i != cfg.bos_token_id]
    assert len(words) >= 2 and all(tok.decode([i]).strip() for i in words), "an ordinary id decodes to no text"
    ids = tok.encode_chat([{"role": "user", "content": "hi there"}])
    assert "hi there" in tok.decode(ids)


def test_a_preset_has_no_weights_to_resolve():
    with pytest.raises(ModelNotFoundError, match="--random-weights"):
        resolve_model("llama-3.1-8b")


def test_the_folder_is_written_once_and_reused(tmp_path):
    first = preset_dir("smollm2-135m")
    stamp = (first / "tokenizer.json").stat().st_mtime_ns
    assert preset_dir("smollm2-135m") == first and (first / "tokenizer.json").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["smollm2-135m"]  # no temporary folder left behind


def test_the_replica_and_proxy_side_stay_torch_free():
    code = ("import sys; from replica.tokenizer import Tokenizer; Tokenizer.from_spec('llama-3.2-1b'); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
