"""The report's plots are readable: no two tick labels of an axis overlap (a log axis
spanning less than a decade used to label every minor tick, "3x10^1 4x10^1"), and a
run of one level draws its throughput and latency as labelled points, not a line."""

import random

import pytest

from loadtest.histogram import Histogram
from loadtest.report import figures

pytest.importorskip("matplotlib")


def run(label: str, lo: float, hi: float, tok_s: float, seed: int) -> dict:
    rng = random.Random(seed)
    hists, timeline = {}, []
    for region in ("eu", "us"):
        ttft, itl = Histogram(), Histogram()
        for i in range(400):
            ttft.record_ms(rng.uniform(lo * 4, hi * 4))
            v = rng.uniform(lo, hi)
            itl.record_ms(v)
            timeline.append((i * 0.05, v, region))
        hists[f"{region}/chat"] = {"ttft": ttft.to_json(), "itl": itl.to_json()}
    q = {"p50": (lo + hi) / 2, "p99": hi}
    return {"label": label, "result": {"histograms": hists, "timeline": timeline,
                                       "totals": {"all": {"throughput_tokens_per_s": tok_s,
                                                          "ttft": {k: 4 * v for k, v in q.items()}, "itl": q}}}}


def overlapping_ticks(fig) -> list[str]:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bad = []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in axis.get_ticklabels(which="both")
                     if t.get_visible() and t.get_text()]
            for i, (a, ba) in enumerate(boxes):
                bad += [f"{a!r} overlaps {b!r}" for b, bb in boxes[i + 1:] if ba.overlaps(bb)]
    return bad


@pytest.mark.parametrize("lo, hi", [(31.0, 48.0), (6.0, 9.0), (0.4, 900.0)])
def test_no_tick_labels_overlap_on_narrow_or_wide_log_axes(lo, hi):
    report = {"runs": [run("rate 2/s", lo, hi, 120.0, 1), run("rate 4/s", lo * 1.1, hi * 1.1, 230.0, 2)]}
    for name, fig in figures(report).items():
        assert not overlapping_ticks(fig), name
        labelled = [t.get_text() for ax in fig.axes for t in ax.get_yticklabels() + ax.get_xticklabels()
                    if t.get_text()]
        assert labelled and not any("times" in t or "^" in t for t in labelled), (name, labelled)


def test_one_level_is_a_labelled_point_not_a_line():
    fig = figures({"runs": [run("rate 2/s", 31.0, 48.0, 120.0, 1)]})["throughput_latency.png"]
    (ax,) = fig.axes
    assert ax.lines and all(line.get_linestyle() == "None" and len(line.get_xdata()) == 1 for line in ax.lines)
    texts = [t.get_text() for t in ax.texts]
    assert "rate 2/s" in texts and any(t.endswith(" ms") for t in texts)
    two = figures({"runs": [run("a", 31.0, 48.0, 120.0, 1), run("b", 35.0, 50.0, 200.0, 2)]})["throughput_latency.png"]
    assert all(line.get_linestyle() != "None" for line in two.axes[0].lines)
