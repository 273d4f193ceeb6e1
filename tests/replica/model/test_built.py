"""replica.model.built: the default model's quantized CPU build, kept by the first start
and loaded by the next, serves exactly what a fresh build serves; a build that does not
match (another quantization, a damaged file) is not used; a folder that cannot be
written costs only the shortcut."""

import logging

import pytest
import torch

import kernels
from replica.config import EngineConfig
from replica.engine.process import build_engine
from replica.model import built
from replica.model.cpu_model import CpuModel
from replica.model.plan import Sampling, StepPlan

GREEDY = Sampling(temperature=0.0, top_k=0, top_p=1.0, seed=0, position=0)
PROMPT = [1, 504, 3458, 282, 4649, 314, 1345, 30, 2]


def config(**kw) -> EngineConfig:
    base = dict(model="default", quantization="gguf", speculative="off", num_blocks=16, cpu_threads=1,
                max_num_batched_tokens=64)
    return EngineConfig(**(base | kw))


def logits(engine) -> torch.Tensor:
    """One prefill of PROMPT through the engine's Runner: the last row's logits."""
    r = engine.runner
    plan = StepPlan(input_ids=PROMPT, starts=[0], num_tokens=[len(PROMPT)], block_tables=[[0]],
                    sample_rows=[0], num_decodes=0, sampling=[GREEDY])
    return r.execute(plan).logits[-1].clone()


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGECHAT_BUILT_DIR", str(tmp_path))
    return tmp_path


def test_the_second_start_loads_the_first_ones_build_and_serves_the_same_logits(folder):
    cfg = config()
    assert built.lookup(cfg, kernels.ops("cpu")) is None
    fresh = build_engine(cfg)
    kept = list(folder.glob("*.safetensors"))
    assert len(kept) == 1 and not list(folder.glob("*.tmp"))
    assert built.lookup(cfg, kernels.ops("cpu")) is not None
    warm = build_engine(cfg)
    assert type(warm.runner.model) is type(fresh.runner.model)
    if kernels.ops("cpu").cpu_step:
        assert isinstance(warm.runner.model, CpuModel)
    assert warm.model_cfg == fresh.model_cfg
    assert torch.equal(logits(warm), logits(fresh))
    fresh.close()
    warm.close()


def test_another_quantization_is_another_build(folder):
    ops = kernels.ops("cpu")
    assert built.key(config(), ops) != built.key(config(quantization="int8"), ops)
    assert built.key(config(quantization="none"), ops) is None  # unquantized checkpoints load directly
    assert built.key(config(random_weights=True), ops) is None


def test_a_damaged_build_is_ignored_and_replaced(folder, caplog):
    cfg = config()
    build_engine(cfg).close()
    (path,) = folder.glob("*.safetensors")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="replica.model.built"):
        assert built.lookup(cfg, kernels.ops("cpu")) is None
    assert "ignoring the kept build" in caplog.text
    build_engine(cfg).close()
    assert built.lookup(cfg, kernels.ops("cpu")) is not None


def test_a_folder_that_cannot_be_written_costs_only_the_shortcut(tmp_path, monkeypatch, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("EDGECHAT_BUILT_DIR", str(blocked / "built"))
    with caplog.at_level(logging.WARNING, logger="replica.model.built"):
        engine = build_engine(config())
    assert "could not keep the built model" in caplog.text
    assert logits(engine).isfinite().all()
    engine.close()
