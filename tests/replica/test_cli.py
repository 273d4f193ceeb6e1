"""`python -m replica`'s flags reach the engine's config."""

from replica.__main__ import engine_config, parse_args


def test_cpu_threads_reach_the_engine_config():
    cfg = engine_config(parse_args(["--device", "cpu", "--quantization", "gguf", "--cpu-threads", "1"]))
    assert cfg.cpu_threads == 1 and cfg.engine_threads() == 1
    cfg = engine_config(parse_args(["--device", "cpu", "--quantization", "gguf"]))
    assert cfg.cpu_threads == 0 and cfg.engine_threads() >= 1  # every core
