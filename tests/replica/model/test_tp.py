"""Tensor parallelism on CPU (gloo): 2 ranks give the same logits and tokens as 1,
and agree on the KV layout when rank 1's memory holds fewer blocks than rank 0's."""

import dataclasses
import json
import subprocess
import sys

import msgspec
import pytest
import torch

from replica.config import EngineConfig
from replica.engine.process import build_engine
from replica.model.tp import local_config, shard
from tests.replica.tiny import tiny_config
from tests.replica.tp_job import run_spec_workload, run_workload

TINY_HF = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
           "tie_word_embeddings": False, "eos_token_id": 0, "bos_token_id": 1}


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


@pytest.mark.timeout(240)
def test_ranks_agree_on_the_kv_layout_rank_1_affords(tmp_path):
    """Rank 1's budget holds 12 blocks, rank 0's 200: rank 0 decides 12 for both. Three
    rounds touch more than 12 distinct blocks (finished prompts stay cached), so a rank 0
    sizing its pool alone would hand rank 1 block ids it does not have."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_HF))
    per_block = 2 * 2 * 16 * 16 * 4  # per rank: 2 layers x {k, v} x 16 slots x (1 KV head x 16) x fp32
    cfg = EngineConfig(model=str(tmp_path), random_weights=True, num_blocks=12, max_num_batched_tokens=16,
                       max_num_seqs=4, cpu_threads=1)
    one = run_workload(build_engine(cfg), rounds=3)
    cfg.num_blocks, cfg.tp, cfg.kv_memory_bytes = 0, 2, 200 * per_block
    worker = dataclasses.replace(cfg, kv_memory_bytes=12 * per_block)
    out = tmp_path / "tp2.pt"
    subprocess.run([sys.executable, "-m", "tests.replica.tp_job", "--config", msgspec.json.encode(cfg).decode(),
                    "--worker-config", msgspec.json.encode(worker).decode(), "--rounds", "3", "--out", str(out)],
                   check=True, timeout=200)
    two = torch.load(out)
    assert two["num_blocks"] == 12
    assert two["tokens"] == one["tokens"] and len(one["tokens"]) == 12


SPECS = {"eagle3-chain": dict(speculative="eagle3", spec_depth=3),
         "eagle3-tree": dict(speculative="eagle3", spec_depth=3, spec_top_k=2, spec_budget=6),
         "ngram": dict(speculative="ngram", spec_depth=3)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", sorted(SPECS))
def test_two_ranks_speculate_as_one(tmp_path, spec):
    """Speculation at tp=2: drafting and acceptance on rank 0 (the head embeds with the
    gathered vocabulary), the verify on both ranks, the accepted drafts' KV moves made by
    rank 1 before the next step. Its tokens are tp=1's with speculation and plain decoding's."""
    from types import SimpleNamespace

    from replica.hf_checkpoint import config_from_hf
    from speculative.head import save_head
    from tests.speculative.util import random_head

    from collections import Counter

    (tmp_path / "config.json").write_text(json.dumps({**TINY_HF, "num_hidden_layers": 4}))
    target = config_from_hf(tmp_path)
    head = tmp_path / "head"
    base = dict(model=str(tmp_path), random_weights=True, num_blocks=48, max_num_batched_tokens=32, max_num_seqs=4,
                cpu_threads=1, spec_head=str(head), spec_policy="taper", spec_max_batch=4)
    plain = run_spec_workload(build_engine(EngineConfig(**base)))
    # A head whose draft tokens (one a child) are the ones the answers repeat most: drafts get accepted.
    stand_in = SimpleNamespace(cfg=target, embed_tokens=SimpleNamespace(weight=torch.zeros(target.vocab_size,
                                                                                         target.hidden_size)))
    k = SPECS[spec].get("spec_top_k", 1)
    eagle = random_head(stand_in, draft_vocab=k)  # its embedding is the target's (not saved)
    common = Counter(t for ids in plain["tokens"].values() for t in ids).most_common(k)
    eagle.d2t.copy_(torch.tensor(sorted(t for t, _ in common)))
    save_head(eagle, head)
    cfg = EngineConfig(**base, **SPECS[spec])
    one = run_spec_workload(build_engine(cfg))
    cfg.tp = 2
    out = tmp_path / "tp2.pt"
    subprocess.run([sys.executable, "-m", "tests.replica.tp_job", "--config", msgspec.json.encode(cfg).decode(),
                    "--spec-workload", "--out", str(out)], check=True, timeout=250)
    two = torch.load(out)
    assert one["tokens"] == plain["tokens"] and len(plain["tokens"]) == 4
    assert two["tokens"] == one["tokens"]
    assert two["accepted"] == one["accepted"] > 0  # drafts were kept, so KV moved on both ranks
