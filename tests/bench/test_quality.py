"""bench/quality.py's one-forward logits (its perplexity, bench/activations.py's logit changes,
bench/sampling.py's rows): every row of a prompt, as the C++ CPU step computes them, against
the last row of a forward over that row's prefix alone (the step's causal attention)."""

import pytest
import torch

from bench.quality import forward_logits
from kernels import cpu_forward
from tests.replica.engines import make_engine
from tests.replica.tiny import tiny_config


def test_forward_logits_gives_every_rows_logits_not_only_the_sampled_row():
    if not cpu_forward.available():
        pytest.skip("the C++ CPU step needs AVX-512 VNNI and a C++ compiler")
    # sizes the packed matmuls take (multiples of 64), heads of 16
    engine, cfg, _ = make_engine(tiny_config(vocab_size=128, hidden_size=64, intermediate_size=128, num_heads=4,
                                             num_kv_heads=2),
                                 quantization="int8", max_num_batched_tokens=64)
    assert type(engine.runner.model).__name__ == "CpuModel"  # the C++ step, which prunes rows nobody reads
    ids = [(7 * i + 3) % cfg.vocab_size for i in range(20)]
    whole = forward_logits(engine, ids)
    assert whole.shape == (20, cfg.vocab_size)
    for i in (0, 5, 18):
        alone = forward_logits(engine, ids[: i + 1], slice(-1, None))[0]
        assert torch.allclose(whole[i], alone, atol=1e-4, rtol=1e-4), i
    assert whole[:-1].abs().amax(-1).min() > 0  # no row left at zeros
