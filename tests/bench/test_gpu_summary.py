"""bench/gpu_summary.py reads the GPU call's tables as bench/decode.py and bench/spec_gpu.py
print them on a GPU (rows shaped as the H200 lease's, docs/perf.md "On a GPU") into the
summary's figures; a stage that did not run leaves its figures null."""

from bench.gpu_summary import summarize

DECODE = """device: NVIDIA H200, torch 2.13.0+cu130, copy bandwidth 4.21 TB/s, context 512, 32 steps

| model | batch | mode | ms/step | tokens/s | roofline ms | x roofline | graph replay ms | GPU idle |
|---|---:|---|---:|---:|---:|---:|---:|---:|
| llama-3.1-8b | 1 | eager | 21.100 | 47 | 3.562 | 5.92 | nan | - |
| llama-3.1-8b | 1 | CUDA graphs | 4.801 | 208 | 3.562 | 1.35 | 4.683 | 2.5% |
| llama-3.1-8b | 1 | graphs + overlap | 4.755 | 210 | 3.562 | 1.33 | 4.683 | 1.5% |
| llama-3.1-8b | 8 | graphs + overlap | 5.018 | 1594 | 3.677 | 1.36 | 4.923 | 1.9% |

### Graphs against eager, every bucket: llama-3.1-8b, context 64, first decode step after prefill, greedy

| bucket | rows | max abs logit diff | top-1 equal |
|---:|---:|---:|---:|
| 1 | 1 | 0 | 1/1 |
| 4 | 3 | 0.0625 | 3/3 |

graphs vs eager: 2 buckets, max abs logit diff 0.0625, top-1 equal 4/4
"""
PEER = """| llama-3.1-8b | 1 | transformers static cache (generate's compile) | 6.210 | 161 | | | | |
| llama-3.1-8b | 8 | transformers static cache (generate's compile) | 7.000 | 1143 | | | | |
"""
SPEC = """batch 1 chain 3: 26.90 ms/step, 1.00 tokens/sequence/step, accepted 0/96 (engine built in 3.1 s; freed)
host syncs per step: chain 3 at batch 1: 15
host syncs per step: tree 32 at batch 4: 43

| step | draft tokens | tau (CPU) | batch 1: ms/step | batch 1: implied | batch 4: ms/step | batch 4: implied |
|---|---:|---:|---:|---:|---:|---:|
| plain decode (CUDA graphs + overlap) | 0 | 1 | 4.58 | 1.00x | 4.90 | 1.00x |
| chain 3 | 3 | 1.59 | 26.90 | 0.27x | 28.00 | 0.28x |
| tree 16 | 16 | 2.09 | 31.10 | 0.31x | 33.00 | 0.31x |
| tree 32 | 32 | 2.26 | 31.20 | 0.33x | 36.00 | 0.31x |
"""


def test_the_figures_come_from_the_tables(tmp_path):
    (tmp_path / "decode.md").write_text(DECODE)
    (tmp_path / "peer.md").write_text(PEER)
    (tmp_path / "spec.md").write_text(SPEC)
    s = summarize(tmp_path, ["decode: rc=0 in 26s"])
    assert (s["card"], s["decode_ms_b1"], s["roofline_ms_b1"], s["peer_ms_b1"]) == ("NVIDIA H200", 4.755, 3.562, 6.21)
    assert s["decode_over_roofline_b1"] == round(4.755 / 3.562, 3)
    assert s["graphs_vs_eager"] == {"buckets": 2, "max_abs_logit_diff": 0.0625, "top1_equal": 4, "rows": 4}
    assert s["host_syncs_per_spec_step"] == 43
    assert s["spec_step_over_plain"] == {"chain3": {"1": round(26.9 / 4.58, 3), "4": round(28 / 4.9, 3)},
                                         "tree16": {"1": round(31.1 / 4.58, 3), "4": round(33 / 4.9, 3)},
                                         "tree32": {"1": round(31.2 / 4.58, 3), "4": round(36 / 4.9, 3)}}
    assert s["spec_implied_speedup"]["best"] == 0.33 and s["spec_implied_speedup"]["at"] == "tree 32 at batch 1"
    assert s["stages"] == ["decode: rc=0 in 26s"]


def test_a_stage_that_did_not_run_leaves_nulls(tmp_path):
    s = summarize(tmp_path)
    assert s["card"] is None and s["decode_ms_b1"] is None and s["peer_ms_b1"] is None
    assert s["graphs_vs_eager"] is None
    assert s["host_syncs_per_spec_step"] is None and s["spec_step_over_plain"] == {}
    assert s["spec_implied_speedup"]["best"] is None


def test_a_failed_bucket_check_is_reported_not_hidden(tmp_path):
    (tmp_path / "decode.md").write_text("device: NVIDIA H200, torch x\n\ngraphs vs eager: FAILED: RuntimeError: boom\n")
    assert summarize(tmp_path)["graphs_vs_eager"] == {"error": "FAILED: RuntimeError: boom"}
