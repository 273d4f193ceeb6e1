"""Sharded loading: a tensor-parallel rank reads only its slices of the checkpoint
(`replica.model.loader.Weights` over `replica.model.tp.shard_range`), tensor by tensor, and
a --tp 1 engine holds the checkpoint about once while it loads. The memory tests measure
each rank in its own process (tests/replica/tp_job.py --measure) on a ~300 MB fp32 folder."""

import math
import os
import subprocess
import sys

import msgspec
import pytest
import torch

from replica.config import EngineConfig
from replica.hf_checkpoint import default_model_path
from replica.model.loader import open_weights
from replica.model.tp import shard
from tests.replica.model.llama_folder import write_llama_folder


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    """(folder, the checkpoint's tensor bytes)."""
    folder = tmp_path_factory.mktemp("medium") / "llama"
    return folder, write_llama_folder(folder)


def measured_run(folder, tmp_path, **kw) -> dict:
    """tests/replica/tp_job.py --measure in its own process: the workload's tokens and logits,
    and "load": each rank's peak RSS above its RSS before loading, and the bytes it read."""
    cfg = EngineConfig(model=str(folder), num_blocks=32, max_num_batched_tokens=16, max_num_seqs=4, cpu_threads=1,
                       **kw)
    out = tmp_path / f"tp{cfg.tp}-{cfg.quantization}.pt"
    env = dict(os.environ, EDGECHAT_BUILT_DIR="off")  # a kept build would skip the load measured here
    subprocess.run([sys.executable, "-m", "tests.replica.tp_job", "--measure", "--config",
                    msgspec.json.encode(cfg).decode(), "--out", str(out)], check=True, timeout=200, env=env)
    return torch.load(out)


@pytest.fixture(scope="module")
def one_rank(medium, tmp_path_factory):
    return measured_run(medium[0], tmp_path_factory.mktemp("tp1"))


@pytest.mark.timeout(240)
def test_one_rank_engine_holds_the_checkpoint_about_once(medium, one_rank, tmp_path):
    """Its peak RSS while loading is at most 1.3x the checkpoint, unquantized and as int4
    (the CPU default for a folder): the model's parameters, filled tensor by tensor from the
    files, and not a dict of the whole checkpoint beside them (that was 2.0x, and 2.2x
    through the quantizer)."""
    _, nbytes = medium
    assert one_rank["load"]["peak"][0] <= 1.3 * nbytes, one_rank["load"]
    int4 = measured_run(medium[0], tmp_path, quantization="int4")
    assert int4["load"]["peak"][0] <= 1.3 * nbytes, int4["load"]
    assert len(int4["tokens"]) == 4


@pytest.mark.timeout(240)
def test_two_ranks_read_only_their_shards(medium, one_rank, tmp_path):
    """Each of 2 ranks reads under 0.6 of the checkpoint's bytes, peaks under 0.6 of a
    --tp 1 engine's RSS on the same folder, and together they give its logits."""
    _, nbytes = medium
    two = measured_run(medium[0], tmp_path, tp=2)
    load = two["load"]
    assert all(read < 0.6 * nbytes for read in load["read"]), (load, nbytes)
    assert all(peak < 0.6 * one_rank["load"]["peak"][0] for peak in load["peak"]), (load, one_rank["load"])
    assert two["tokens"] == one_rank["tokens"] and len(two["tokens"]) == 4
    for k, v in one_rank["logits"].items():
        torch.testing.assert_close(two["logits"][k], v, rtol=1e-4, atol=1e-5)


def test_rank_slices_are_the_shards_of_the_whole_safetensors(medium):
    """Every rank's tensors, read as its slices, are `shard` of the whole checkpoint's;
    and what the ranks read adds up to the checkpoint once (replicated norms once each)."""
    folder, nbytes = medium
    _, whole, _ = open_weights(str(folder))
    ranks = [open_weights(str(folder), rank=r, world=2)[1] for r in range(2)]
    names = [n for n in whole if ".layers.1." in n or not n.startswith("model.layers.")]
    for name in names:
        full = {name: whole[name]}
        for r, w in enumerate(ranks):
            assert torch.equal(w[name], shard(full, r, 2)[name]), (name, r)
    assert ranks[0].bytes_read == ranks[1].bytes_read
    norms = sum(4 * math.prod(whole.shapes[n]) for n in names if n.endswith("norm.weight"))  # fp32, read by both
    assert ranks[0].bytes_read + ranks[1].bytes_read == whole.bytes_read + norms


def test_rank_slices_of_the_default_gguf_are_its_shards():
    """GGUF: a rank decodes only its rows or whole blocks of its columns, and un-permutes
    its Q/K heads alone; the same tensors as `shard` of the whole, dequantized. SmolLM2's
    9 query / 3 KV heads, 1536 FFN rows and 49152 vocab rows split 3 ways (tied head)."""
    path = default_model_path()
    _, whole, _ = open_weights(path)
    ranks = [open_weights(path, rank=r, world=3)[1] for r in range(3)]
    names = [n for n in whole if ".layers.0." in n or not n.startswith("model.layers.")]
    assert {"model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"} <= set(names)
    for name in names:
        full = {name: whole[name]}
        for r, w in enumerate(ranks):
            assert torch.equal(w[name], shard(full, r, 3)[name]), (name, r)
    assert sum(w.bytes_read for w in ranks) < 1.1 * whole.bytes_read
