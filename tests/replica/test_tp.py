"""Tensor parallelism on CPU (gloo): 2 ranks give the same logits and tokens as 1."""

import json
import subprocess
import sys

import msgspec
import pytest
import torch

from wire import protocol as P
from replica.config import EngineConfig
from replica.engine_process import build_engine
from replica.tp import local_config, shard
from tests.replica.tiny import tiny_config

TINY_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
           "tie_word_embeddings": False, "eos_token_id": 0, "bos_token_id": 1}


def run_workload(engine):
    """Greedy and seeded requests with chunked prefill; {id: [logits rows]} and tokens."""
    sp = [P.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
          P.SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)]
    for i in range(4):
        engine.add(P.Generate(id=f"r{i}", prompt_ids=[(5 * i + j) % 120 + 2 for j in range(10 + 9 * i)],
                              sampling=sp[i % 2]))
    logits, tokens = {}, {}
    while engine.has_work():
        res = engine.step(return_logits=True)
        out, lg = res if isinstance(res, tuple) else (res, {})  # with overlap: tokens only
        for k, v in lg.items():
            logits.setdefault(k, []).append(v.clone())
        for m in out:
            tokens.setdefault(m.id, []).extend(m.ids)
    return {"logits": {k: torch.stack(v) for k, v in logits.items()}, "tokens": tokens}


def test_shards_cover_the_weights():
    cfg = tiny_config(num_heads=4, num_kv_heads=2, vocab_size=96)
    local = local_config(cfg, 2)
    assert (local.num_heads, local.num_kv_heads, local.head_dim) == (2, 1, cfg.head_dim)
    w = {"model.layers.0.self_attn.q_proj.weight": torch.randn(cfg.q_size, cfg.hidden_size),
         "model.layers.0.self_attn.o_proj.weight": torch.randn(cfg.hidden_size, cfg.q_size),
         "model.norm.weight": torch.randn(cfg.hidden_size)}
    a, b = shard(w, 0, 2), shard(w, 1, 2)
    q, o = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    assert torch.equal(torch.cat([a[q], b[q]]), w[q]) and torch.equal(torch.cat([a[o], b[o]], 1), w[o])
    assert a["model.norm.weight"] is w["model.norm.weight"]
    with pytest.raises(ValueError, match="num_heads"):
        local_config(tiny_config(), 4)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_two_ranks_match_one_rank(tmp_path, overlap):
    """With overlap, each rank samples every step itself and resolves the next step's
    placeholders from its own copy of the tokens."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF))
    cfg = EngineConfig(model=str(tmp_path), random_weights=True, num_blocks=32, max_num_batched_tokens=16,
                       max_num_seqs=4, cpu_threads=1)
    one = run_workload(build_engine(cfg))
    cfg.tp, cfg.overlap = 2, overlap
    out = tmp_path / "tp2.pt"
    subprocess.run([sys.executable, "-m", "tests.replica.tp_job", "--config", msgspec.json.encode(cfg).decode(),
                    "--out", str(out)], check=True, timeout=200)
    two = torch.load(out)
    assert two["tokens"] == one["tokens"] and len(one["tokens"]) == 4
    if overlap:
        return  # no logits from an overlapped step
    for k, v in one["logits"].items():
        assert torch.allclose(two["logits"][k], v, atol=1e-5), k
