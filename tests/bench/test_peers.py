"""bench/peers.py's reading of a replica's own engine steps (its /metrics) around a workload."""

import pytest

from bench.peers import parse_steps, print_chat, steps_between
from replica.api.metrics import ReplicaMetrics
from wire import protocol as P


def reading(counts: list[int], cpu: int, solo: int) -> dict:
    load = P.Load(running=0, waiting=0, free_blocks=1, total_blocks=1, step_counts=counts, step_seconds=1.0,
                  cpu_steps=cpu, cpu_solo_steps=solo)
    return parse_steps(ReplicaMetrics(lambda: load).render().decode())


def test_a_workloads_steps_are_the_difference_of_two_readings():
    """Steps between two readings of the replica's histogram: how many, the bucket bounds under which half and
    99 % fall, the share over 50 ms and the share on one thread; nothing from a replica without the histogram."""
    k = len(P.STEP_BUCKETS_S) + 1
    i10, i50, i75 = (P.STEP_BUCKETS_S.index(b) for b in (0.01, 0.05, 0.075))
    before = [0] * k
    before[i10] = 500  # the warm-up's steps: not the workload's
    after = list(before)
    after[i10] += 40
    after[i50] += 59
    after[i75] += 1
    s = steps_between(reading(before, 500, 400), reading(after, 600, 410))
    assert s["steps"] == 100 and s["p50_le"] == 50.0 and s["p99_le"] == 50.0 and s["over_50ms"] == pytest.approx(0.01)
    assert s["solo"] == pytest.approx(0.1)
    after[i75] += 1  # a second slow step: now past the 99th percentile
    s = steps_between(reading(before, 500, 400), reading(after, 601, 410))
    assert s["p99_le"] == 75.0 and s["p50_le"] == 50.0
    assert parse_steps("# an older replica's /metrics\nedgechat_replica_step_ms 30.0\n") is None
    assert steps_between(None, reading(after, 1, 0)) is None


def test_a_server_whose_chat_workload_failed_keeps_its_row_and_says_why(capsys):
    ok = {"itl_p50": 30.0, "itl_p99": 50.0, "tok_s": 400.0, "ttft_first": 250.0, "ttft_later": 150.0}
    rows = [{"name": "llama", "chat": {16: {"error": "APIConnectionError: Connection error."}}},
            {"name": "ours", "chat": {16: ok}}]
    print_chat(rows, [16], 6)
    out = capsys.readouterr().out
    assert "| llama | failed | - | - |" in out and "| ours | 30.0 / 50.0 | 400.0 | 250 / 150 |" in out
    assert "- llama, 16 streams: the chat workload failed: APIConnectionError: Connection error." in out
