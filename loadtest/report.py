"""Reports of a load test: JSON (every figure), Markdown tables, PNG plots, one HTML file.

A report holds one or more runs (load levels, routing modes); each run's result
is `driver.Run.run()`'s dict. Files written to `out_dir`:

    report.json            everything, including sparse histogram counts
    report.md              per-run tables; per-region table across runs; routing comparison
    ttft_cdf.png, itl_cdf.png      latency CDFs per region (one line per run)
    itl_over_time.png      every inter-token gap of each run against time, per region
    throughput_latency.png output tokens/s against TTFT and ITL percentiles, one point per run
    report.html            self-contained: the tables and the plots embedded as data URIs
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

PLOTS = ("ttft_cdf.png", "itl_cdf.png", "itl_over_time.png", "throughput_latency.png")


def _f(x, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{digits}f}"


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def run_table(run: dict) -> list[str]:
    r = run["result"]
    rows = ["| region | workload | req | TTFT p50 / p90 / p99 / p99.9 ms | ITL p50 / p99 / p99.9 ms | TPOT p50 ms "
            "| E2E p50 / p99 ms | goodput | cached | rejected | errors | cancels sent / honoured |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    groups = [(g["region"], g["workload"], g) for g in r["groups"]]
    groups += [(k.split(":", 1)[1] if k.startswith("region:") else "all", "all", g)
               for k, g in r["totals"].items() if k.startswith("region:") or k == "all"]
    for region, workload, g in groups:
        t, i, tp, e = g["ttft"], g["itl"], g["tpot"], g["e2e"]
        c = g["cancellations"]
        rows.append(
            f"| {region} | {workload} | {g['requests']} | {_f(t['p50'])} / {_f(t['p90'])} / {_f(t['p99'])} / "
            f"{_f(t['p99.9'])} | {_f(i['p50'])} / {_f(i['p99'])} / {_f(i['p99.9'])} | {_f(tp['p50'])} | "
            f"{_f(e['p50'], 0)} / {_f(e['p99'], 0)} | {_pct(g['goodput_fraction'])} | "
            f"{_pct(g['cached_token_ratio'])} | {sum(g['rejections'].values())} | {sum(g['errors'].values())} | "
            f"{c['sent']} / {c['honoured']} |")
    return rows


def region_table(runs: list[dict]) -> list[str]:
    """TTFT and ITL p50/p99 per region and workload, one column group per run."""
    labels = [run["label"] for run in runs]
    head = "| region | workload | " + " | ".join(f"{lb}: TTFT p50 / p99 | {lb}: ITL p50 / p99" for lb in labels) + " |"
    rows = [head, "|---|---|" + "---:|---:|" * len(labels)]
    keys = sorted({(g["region"], g["workload"]) for run in runs for g in run["result"]["groups"]})
    for region, workload in keys:
        cells = []
        for run in runs:
            g = next((g for g in run["result"]["groups"] if (g["region"], g["workload"]) == (region, workload)), None)
            if g is None:
                cells += ["–", "–"]
            else:
                cells += [f"{_f(g['ttft']['p50'], 0)} / {_f(g['ttft']['p99'], 0)}",
                          f"{_f(g['itl']['p50'], 0)} / {_f(g['itl']['p99'], 0)}"]
        rows.append(f"| {region} | {workload} | " + " | ".join(cells) + " |")
    return rows


def routing_table(runs: list[dict]) -> list[str]:
    rows = ["| routing | req | TTFT p50 / p99 ms | ITL p50 / p99 ms | E2E p50 / p99 ms | cached tokens | goodput "
            "| tokens/s | requests per replica |", "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for run in runs:
        g = run["result"]["totals"].get("all")
        if g is None:
            continue
        spread = ", ".join(f"{k} {v}" for k, v in g["replicas"].items())
        rows.append(f"| {run.get('routing', run['label'])} | {g['requests']} | {_f(g['ttft']['p50'], 0)} / "
                    f"{_f(g['ttft']['p99'], 0)} | {_f(g['itl']['p50'], 0)} / {_f(g['itl']['p99'], 0)} | "
                    f"{_f(g['e2e']['p50'], 0)} / {_f(g['e2e']['p99'], 0)} | {_pct(g['cached_token_ratio'])} | "
                    f"{_pct(g['goodput_fraction'])} | {_f(g['throughput_tokens_per_s'])} | {spread} |")
    return rows


def markdown(report: dict) -> str:
    meta, runs = report["meta"], report["runs"]
    out = [f"# Load test: {meta.get('title', 'edgechat')}", "",
           f"Command: `{meta.get('command', '')}`  ", f"Machine: {meta.get('machine', '')}  ",
           f"Workloads: {meta.get('workloads', '')}; SLOs (ms): {meta.get('slos_ms') or 'none'}", ""]
    compare = [r for r in runs if r.get("routing")]
    if len({r.get("routing") for r in compare}) > 1:
        out += ["## Routing comparison", "", *routing_table(compare), ""]
    out += ["## Per region and workload, by run", "", *region_table(runs), ""]
    for run in runs:
        r = run["result"]
        out += [f"## Run {run['label']}", "",
                f"{r['duration_s']:.1f} s, {r['sessions']} sessions, {r['requests_sent']} requests sent; "
                f"locations {json.dumps(r['locations'])}", "", *run_table(run), ""]
        if r["notes"]:
            out += ["Notes: " + "; ".join(r["notes"]), ""]
    return "\n".join(out) + "\n"


def _hist(counts: dict):
    from loadtest.histogram import Histogram

    return Histogram.from_json(counts)


def _ms(v: float, _pos=None) -> str:
    return f"{v:g}" if v >= 1 else f"{v:.2g}"


def _log_axis(axis) -> None:
    """A log axis labelled at 1-2-5 steps in plain numbers, minor ticks unlabelled:
    matplotlib's default labels every minor tick of a range under a decade in
    scientific form, and neighbours run into each other ("3x10^1 4x10^1")."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(_ms))
    axis.set_minor_formatter(NullFormatter())


def figures(report: dict) -> dict:
    """file name -> matplotlib figure: TTFT and ITL CDFs per region, ITL over time per
    run, throughput against latency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    out = {}
    for metric, name in (("ttft", "ttft_cdf.png"), ("itl", "itl_cdf.png")):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for run in runs:
            by_region: dict = {}
            for key, hs in run["result"]["histograms"].items():
                region = key.split("/", 1)[0]
                by_region.setdefault(region, []).append(_hist(hs[metric]))
            for region, hs in sorted(by_region.items()):
                h = hs[0]
                for o in hs[1:]:
                    h.merge(o)
                if h.n:
                    xs, ys = h.cdf_ms()
                    ax.step(xs, ys, where="post", label=f"{region} · {run['label']}")
        ax.set_xscale("log")
        _log_axis(ax.xaxis)
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(f"{metric.upper()} CDF per region")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        out[name] = fig

    fig, axes = plt.subplots(len(runs), 1, figsize=(7, 2.4 * len(runs) + 0.6), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        by_region = {}
        for t, itl, region in run["result"].get("timeline", []):
            by_region.setdefault(region, ([], []))
            by_region[region][0].append(t)
            by_region[region][1].append(itl)
        for region, (ts, vs) in sorted(by_region.items()):
            ax.scatter(ts, vs, s=2, label=region, alpha=0.5)
        ax.set_yscale("log")
        _log_axis(ax.yaxis)
        ax.set_ylabel("ITL (ms)")
        ax.set_title(run["label"], fontsize=9)
        ax.grid(True, alpha=0.3)
        if by_region:
            ax.legend(fontsize=7, markerscale=4)
    axes[-1, 0].set_xlabel("time since start (s)")
    fig.tight_layout()
    out["itl_over_time.png"] = fig

    fig, ax = plt.subplots(figsize=(7, 4.2))
    pts = [(run["label"], run["result"]["totals"].get("all")) for run in runs]
    pts = [(lb, g) for lb, g in pts if g is not None]
    one = len(pts) == 1  # a single level is a point with its figures, not a curve
    for key, marker, line in (("ttft", "o", "-"), ("itl", "s", "--")):
        for q in ("p50", "p99"):
            xs = [g["throughput_tokens_per_s"] or 0 for _, g in pts]
            ys = [g[key][q] if g[key][q] is not None else math.nan for _, g in pts]
            ax.plot(xs, ys, marker=marker, linestyle="none" if one else line, label=f"{key.upper()} {q}")
            if one and not math.isnan(ys[0]):
                ax.annotate(f"{_ms(ys[0])} ms", (xs[0], ys[0]), xytext=(6, -3), textcoords="offset points", fontsize=7)
    for lb, g in pts:
        ax.annotate(lb, (g["throughput_tokens_per_s"] or 0, g["ttft"]["p99"] or 0), xytext=(-6, 6),
                    textcoords="offset points", fontsize=7, ha="right")
    ax.set_yscale("log")
    _log_axis(ax.yaxis)
    ax.set_xlabel("output tokens/s (all regions)")
    ax.set_ylabel("latency (ms)")
    ax.set_title("Throughput vs latency: one run" if one else "Throughput vs latency, one point per run")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out["throughput_latency.png"] = fig
    return out


def plots(report: dict, out_dir: Path) -> list[Path]:
    import matplotlib.pyplot as plt

    paths = []
    for name, fig in figures(report).items():
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


def _md_to_html(md: str) -> str:
    """The few Markdown constructs report.md uses: headings, tables, paragraphs, inline code."""
    out, table = [], []

    def inline(s: str) -> str:
        s = html.escape(s)
        parts = s.split("`")
        return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))

    def flush():
        if table:
            rows = [r for r in table if not set(r.replace("|", "").strip()) <= set("-:")]
            cells = [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows]
            out.append("<table><tr>" + "".join(f"<th>{inline(c)}</th>" for c in cells[0]) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in row) + "</tr>"
                                 for row in cells[1:]) + "</table>")
            table.clear()

    for line in md.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush()
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{inline(line.lstrip('#').strip())}</h{level}>")
        elif line.strip():
            out.append(f"<p>{inline(line.strip())}</p>")
    flush()
    return "\n".join(out)


def html_page(md: str, images: list[Path]) -> str:
    imgs = "".join(f'<figure><img alt="{p.name}" src="data:image/png;base64,'
                   f'{base64.b64encode(p.read_bytes()).decode()}"><figcaption>{p.name}</figcaption></figure>'
                   for p in images)
    style = ("body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;"
             "font-size:12px;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}"
             "td:first-child,td:nth-child(2),th{text-align:left}img{max-width:100%}figure{display:inline-block;"
             "margin:0.5em;max-width:48%}code{background:#f4f4f4}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>edgechat load test</title>"
            f"<style>{style}</style></head><body>{_md_to_html(md)}<h2>Plots</h2>{imgs}</body></html>\n")


def write(report: dict, out_dir: str | Path, with_plots: bool = True) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "report.json", "md": out / "report.md", "html": out / "report.html"}
    files["json"].write_text(json.dumps(report, indent=1, allow_nan=False, default=_json_default))
    md = markdown(report)
    files["md"].write_text(md)
    images = plots(report, out) if with_plots else []
    files["html"].write_text(html_page(md, images))
    for p in images:
        files[p.stem] = p
    return files


def _json_default(o):
    raise TypeError(f"not JSON serializable: {type(o).__name__}")
