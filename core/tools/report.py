"""The comparison as one self-contained HTML file: tables and figures, images inlined, nothing fetched."""

from __future__ import annotations

import base64
import html
from pathlib import Path

from npumoe.core.base.io import write_output
from npumoe.core.base.outputs import OutputKind, claim
from npumoe.core.planning.profile import RoutingProfile
from npumoe.core.tools.compare import SPLIT_HEADERS, SPLIT_TITLE, split_cells
from npumoe.core.tools.plots import estimates_figure, png, profile_heatmap_figure, target_costs_figure

MARK = '<meta name="generator" content="npumoe compare">'
REPORT = OutputKind("an npumoe HTML report", directory=False,
                    recognise=lambda path: path.is_file() and MARK in path.read_text(errors="replace")[:2000])

ACCURACY_COLUMNS = 5  # the first five of COLUMNS; the rest are costs
COLUMNS = (  # (key, header, format, what it means)
    ("cosine", "cosine", "{:.5f}", "of each held-out position's logits with the fp32 reference's, averaged"),
    ("top1_agreement", "top-1", "{:.1%}", "positions whose most likely next token is the reference's"),
    ("greedy_match", "greedy", "{}", "greedy tokens equal to the reference's from the start"),
    ("perplexity", "perplexity", "{:.3f}", "on the held-out text (the reference's is in the next column)"),
    ("reference_perplexity", "ref. ppl", "{:.3f}", "the fp32 reference's perplexity on the same text"),
    ("padded_pct", "pad %", "{:.1f}", "of NPU expert slots, padding"),
    ("spilled_pct", "spill %", "{:.1f}", "of routed token-slots, run on the CPU past a group's capacity"),
    ("dropped_pct", "drop %", "{:.1f}", "of routed token-slots, dropped"),
    ("npu_launches_per_chunk", "NPU/chunk", "{:.1f}", "NPU graph launches per prefill chunk (measured)"),
    ("npu_launches_per_decode", "NPU/step", "{:.0f}", "NPU graph launches per decode step (from the plan)"),
    ("graphs", "graphs", "{}", "compiled graphs"),
    ("artifact_bytes", "MB", "{:.1f}", "artifact bytes on disk, MB"),
)


def cell(row: dict, key: str, fmt: str) -> str:
    value = row[key] / 1e6 if key == "artifact_bytes" else row[key]
    return fmt.format(value)


def write_html(result: dict, out_dir, path) -> Path:
    """The report for ``result`` (:func:`npumoe.core.tools.compare.compare` of ``out_dir``) at ``path``."""
    path = claim(path, REPORT, "--html")
    rows = result["targets"]
    figures = [target_costs_figure(rows), estimates_figure(rows)]
    profile = Path(out_dir) / "profile.json"
    if profile.is_file():
        figures.append(profile_heatmap_figure(RoutingProfile.load(profile)))
    images = "".join(f'<img alt="figure" src="data:image/png;base64,{base64.b64encode(png(f)).decode()}">'
                     for f in figures)
    head = "".join(f"<th>{html.escape(h)}</th>" for _, h, _, _ in COLUMNS)
    body = "".join(f"<tr><th>{html.escape(t)}</th>" + "".join(f"<td>{cell(r, k, f)}</td>" for k, _, f, _ in COLUMNS)
                   + "</tr>" for t, r in rows.items())
    legend = "".join(f"<li><b>{html.escape(h)}</b>: {html.escape(m)}</li>" for _, h, _, m in COLUMNS)
    estimates = "".join(f"<tr><td>{html.escape(t)}</td><td>{html.escape(d)}</td><td>{e['decode_tok_s']:.1f}</td>"
                        f"<td>{e['prefill_tok_s']:.0f}</td></tr>" for t, r in rows.items()
                        for d, e in r["estimated"].items())
    checks = "".join(f"<tr><td>{html.escape(c['device'])}</td><td>{html.escape(c['label'])}: "
                     f"{html.escape(c['assumptions'])}</td>"
                     f"<td>{c['published_tok_s']:.1f}</td><td>{c['estimate_tok_s']:.1f}</td><td>{c['ratio']:.2f}</td>"
                     f"<td>{html.escape(c['source'])}</td></tr>" for c in result["cost_model_check"])
    split = result.get("disaggregated", [])
    split_head = "".join(f"<th>{html.escape(h)}</th>" for h in SPLIT_HEADERS)
    split_body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>"
                         for cells in split_cells(split))
    assumed = "".join(f"<li>assumed: {html.escape(line)}</li>" for line in (split[0]["assumptions"] if split else ()))
    split_table = (f"<h2>{html.escape(SPLIT_TITLE)}</h2>\n<table><tr>{split_head}</tr>{split_body}</table>"
                   f"<ul>{assumed}</ul>") if split else ""
    sources = "".join(f"<tr><td>{html.escape(d['name'])}</td><td>{d['npu_tops']:g}</td><td>{d['dram_gb_s']:g}</td>"
                      f"<td>{d['launch_us']:g}</td><td>"
                      f"{'<br>'.join(html.escape(f'{k}: {v}') for k, v in d['sources'].items())}"
                      "</td></tr>" for d in result["devices"])
    page = f"""<!doctype html><html><head><meta charset="utf-8">{MARK}
<title>npumoe compare: {html.escape(result['model'])}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}img{{max-width:100%;display:block;margin:1em 0}}</style>
</head><body><h1>{html.escape(result['model'])}: every target against the fp32 reference</h1>
<p>{result['heldout_tokens']} held-out tokens, text the calibration did not see.</p>
<table><tr><th>target</th>{head}</tr>{body}</table><ul>{legend}</ul>{images}
<h2>Estimated tokens/s per device (cost model, not measured)</h2>
<table><tr><th>target</th><th>device</th><th>decode tok/s</th><th>prefill tok/s</th></tr>{estimates}</table>
{split_table}
<h2>The cost model against published figures it was not fitted to</h2>
<table><tr><th>device</th><th>what</th><th>published tok/s</th><th>estimate</th><th>estimate / published</th>
<th>source</th></tr>{checks}</table>
<h2>Device records</h2>
<table><tr><th>device</th><th>NPU TOPS</th><th>DRAM GB/s</th><th>launch µs</th><th>sources</th></tr>{sources}</table>
</body></html>"""
    return write_output(path, REPORT, page, "--html")
