"""`python -m replica`'s flags reach the engine's config."""

import subprocess
import sys

import torch

from replica.__main__ import engine_config, parse_args


def test_cpu_threads_reach_the_engine_config():
    cfg = engine_config(parse_args(["--device", "cpu", "--quantization", "gguf", "--cpu-threads", "1"]))
    assert cfg.cpu_threads == 1 and cfg.engine_threads() == 1
    cfg = engine_config(parse_args(["--device", "cpu", "--quantization", "gguf"]))
    assert cfg.cpu_threads == 0 and cfg.engine_threads() >= 1  # every core


def test_the_kv_cache_dtype_reaches_the_engine_config():
    assert engine_config(parse_args(["--device", "cpu"])).kv_cache_dtype == "auto"
    assert engine_config(parse_args(["--device", "cpu", "--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"


def test_without_a_device_flag_a_cpu_torch_build_serves_on_cpu_and_the_api_process_never_imports_torch():
    code = ("import sys; from replica.__main__ import engine_config, parse_args; "
            "cfg = engine_config(parse_args([])); print(cfg.device, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["cuda" if torch.cuda.is_available() else "cpu", "False"]


def test_the_step_budget_and_seats_defaults_fit_each_other():
    """CPU: a 32-token step budget (the 16-stream tails of docs/perf.md) and as many seats; more seats
    asked for raise the default budget to one token each; a budget asked for bounds the default seats."""
    cpu = ["--device", "cpu", "--quantization", "gguf"]
    cfg = engine_config(parse_args(cpu))
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (32, 32)
    cfg = engine_config(parse_args(cpu + ["--max-num-seqs", "40"]))
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (40, 40)
    cfg = engine_config(parse_args(cpu + ["--max-num-batched-tokens", "128"]))
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (128, 64)
    cfg = engine_config(parse_args(cpu + ["--max-num-batched-tokens", "16"]))
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (16, 16)
    cfg = engine_config(parse_args(["--device", "cuda", "--quantization", "none"]))
    assert (cfg.max_num_batched_tokens, cfg.max_num_seqs) == (512, 64)
