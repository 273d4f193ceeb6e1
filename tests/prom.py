"""Prometheus text as the tests read it: every sample by its series name
(`name{label="value",...}`, labels sorted), parsed by prometheus_client's own parser;
and every series name a scrape declares, samples or not."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

# The series a family of each type writes (prometheus_client strips a counter's `_total`).
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",),
            "summary": ("", "_sum", "_count"), "untyped": ("",)}


def series(name: str, labels: dict) -> str:
    if not labels:
        return name
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def samples(text: str) -> dict[str, float]:
    """{series: value} of a scrape."""
    return {series(s.name, s.labels): s.value for fam in text_string_to_metric_families(text) for s in fam.samples}


def declared(text: str) -> set[str]:
    """The metric names a scrape exports: every family's series, those without samples yet too
    (a labelled counter nothing has counted is still declared by its # TYPE line)."""
    out = set()
    for fam in text_string_to_metric_families(text):
        out.update(fam.name + suffix for suffix in SUFFIXES[fam.type])
        out.update(s.name for s in fam.samples)
    return out
