"""The decode-graph path (replica/model/graphs.py) on CPU: graph_mode="buffers" runs the
same padded buffers and static outputs a replay uses, eagerly. Metadata staging,
padding rows, the columns copied, the lifetime of what a step returns, and an
engine's memory going back when it is dropped."""

import gc
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

import kernels
from replica.config import EngineConfig
from replica.engine.llm_engine import LLMEngine
from replica.model.graphs import DecodeGraphs, default_buckets
from replica.model.plan import StepPlan
from replica.model.runner import build_model
from tests.replica.tiny import tiny_config, tiny_weights

BS = 16
ROOT = Path(__file__).resolve().parents[3]


def decode_plan(tables, starts, ids=None):
    n = len(tables)
    return StepPlan(input_ids=ids or list(range(1, n + 1)), starts=starts, num_tokens=[1] * n, block_tables=tables,
                    sample_rows=list(range(n)), num_decodes=n)


def graphs_over(kv=None, max_num_seqs=8, max_model_len=512, model=None, aux=()):
    kv = kv if kv is not None else torch.zeros(1)
    return DecodeGraphs(model, kv, BS, aux, max_num_seqs, max_model_len, capture=False)


def test_buckets_cover_every_batch_size():
    assert default_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_buckets(6) == [1, 2, 4, 6]
    g = graphs_over(max_num_seqs=20)
    assert g.buckets == [1, 2, 4, 8, 16, 20]
    assert [g.bucket_for(n) for n in (1, 3, 5, 17, 20, 21)] == [1, 4, 8, 20, 20, None]


def test_prepare_writes_rows_pads_to_the_bucket_and_copies_only_the_used_columns():
    g = graphs_over(max_num_seqs=8, max_model_len=512)  # 32 blocks a row at most
    g.block_tables.fill_(-5)  # sentinel: what prepare does not write stays
    tables = [[3, 9], [4], [7, 8, 11]]
    starts = [20, 5, 40]
    b = g.prepare(decode_plan(tables, starts, ids=[11, 12, 13]))
    assert b == 4
    assert g.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert g.positions[:4].tolist() == [20, 5, 40, 0]
    assert g.slots[:4].tolist() == [9 * BS + 4, 4 * BS + 5, 11 * BS + 8, -1]  # padding row: no KV write
    assert g.seq_lens[:4].tolist() == [21, 6, 41, 0]  # padding row: attends to nothing
    assert g.block_tables[:4, :3].tolist() == [[3, 9, 0], [4, 0, 0], [7, 8, 11], [0, 0, 0]]
    assert (g.block_tables[:, 3:] == -5).all() and (g.block_tables[4:] == -5).all()  # widest row: 3 columns


def test_a_later_step_with_other_rows_sees_none_of_the_earlier_ones():
    g = graphs_over(max_num_seqs=8)
    g.prepare(decode_plan([[1, 2, 3, 4], [5, 6, 7, 8], [9], [10]], [60, 60, 3, 3]))
    g.prepare(decode_plan([[20], [21, 22]], [2, 17], ids=[-1, 7]))  # -1: a placeholder, no prev tokens given
    assert g.block_tables[:2, :2].tolist() == [[20, 0], [21, 22]]
    assert g.slots[:2].tolist() == [20 * BS + 2, 22 * BS + 1]
    assert g.seq_lens[:2].tolist() == [3, 18]


def test_placeholders_resolve_from_the_previous_steps_tokens_on_the_device():
    g = graphs_over()
    g.prepare(decode_plan([[1], [2], [3]], [0, 0, 0], ids=[-2, 42, -1]), prev_tokens=torch.tensor([7, 8]))
    assert g.input_ids[:3].tolist() == [8, 42, 7]


@pytest.fixture
def tiny_graphs():
    """Graphs (eager, "buffers") over a tiny model with aux features, and an engine-free KV pool."""
    cfg = tiny_config()
    ecfg = EngineConfig(device="cpu", graph_mode="off", num_blocks=16, max_num_seqs=4)
    model = build_model(cfg, ecfg, tiny_weights(cfg), kernels.ops("cpu", impl="ref"), 512)
    kv = torch.zeros(cfg.num_layers, 2, 16, BS, cfg.num_kv_heads, cfg.head_dim)
    return DecodeGraphs(model, kv, BS, (0, 1), 4, 512, capture=False), cfg


def test_logits_are_the_static_output_and_aux_features_outlive_the_next_step(tiny_graphs):
    """As a replay does, each run writes the bucket's static outputs: the logits returned
    are valid until the next run, while the aux features (kept by an EAGLE-3 head across
    steps) are the caller's own."""
    g, cfg = tiny_graphs
    logits1, aux1 = g.run(decode_plan([[1], [2]], [0, 0], ids=[5, 6]))
    kept_aux, kept_logits = aux1.clone(), logits1.clone()
    assert aux1.shape == (2, 2 * cfg.hidden_size)  # two aux layers
    logits2, aux2 = g.run(decode_plan([[3], [4]], [0, 0], ids=[30, 40]))
    assert not torch.equal(logits2, kept_logits) and not torch.equal(aux2, kept_aux)
    assert logits1.data_ptr() == logits2.data_ptr()  # the one static buffer, as under replay
    assert torch.equal(aux1, kept_aux)  # the first step's features did not move


def test_an_engine_gives_its_memory_back_when_dropped():
    """No reference cycle holds a dropped engine (the runner and its graphs pointed at each
    other): its KV pool and model go at once, not at some later garbage collection, so the
    next engine on a GPU finds the memory free (bench/decode.py builds several)."""
    cfg = tiny_config()
    ecfg = EngineConfig(device="cpu", num_blocks=32, max_num_seqs=4, max_num_batched_tokens=32, graph_mode="buffers")
    LLMEngine(ecfg, cfg, tiny_weights(cfg))  # first build: lazy imports leave garbage of their own
    gc.collect()
    engine = LLMEngine(ecfg, cfg, tiny_weights(cfg))
    assert engine.runner.graphs is not None
    kv, model = weakref.ref(engine.runner.kv_cache), weakref.ref(engine.runner.model)
    gc.disable()
    try:
        del engine
        assert kv() is None and model() is None
    finally:
        gc.enable()


def test_a_bf16_model_is_allocated_in_bf16():
    """build_model casts on the meta device before allocating: no parameter ever exists in
    fp32 on its way to bf16 (an 8B model would pass through 32 GB). In a fresh interpreter:
    torch's mode stacks carry state from earlier tests."""
    proc = subprocess.run([sys.executable, "-c", ALLOCATIONS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["bf16", "fp32-rope", "big-fp32:", "0"], proc.stdout


ALLOCATIONS = """
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import kernels
from replica.config import EngineConfig
from replica.model.runner import build_model
from tests.replica.tiny import tiny_config

seen = []

class Allocations(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.empty_strided) \\
                and isinstance(out, torch.Tensor) and out.device.type == "cpu":
            seen.append((out.dtype, out.numel()))
        return out

cfg = tiny_config(vocab_size=4096)  # the embedding dwarfs the rotary table
with Allocations():
    model = build_model(cfg, EngineConfig(device="cpu", dtype="bfloat16", graph_mode="off"), None,
                        kernels.ops("cpu", impl="ref"), 512)
print("bf16" if model.embed_tokens.weight.dtype == torch.bfloat16 else model.embed_tokens.weight.dtype)
print("fp32-rope" if model.cos_sin.dtype == torch.float32 else model.cos_sin.dtype)
print("big-fp32:", sum(1 for dt, n in seen if dt == torch.float32 and n >= cfg.vocab_size * cfg.hidden_size))
"""
