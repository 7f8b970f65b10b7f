"""``--trace``: one Chrome-trace timeline (chrome://tracing, Perfetto) of host work and the HTP's own profile.

Three synthetic threads, as in the QNN runtime notes this follows:

* ``Host``: the engine's timed host steps (embed, routing, gather, attention, …), from
  :class:`~npumoe.core.runtime.metrics.Metrics` spans;
* ``HTP graphs``: every graph launch, host-timed around ``session.run``, with the HTP's
  accelerator cycles and QNN execute time for that run in its args;
* ``HTP ops``: each launch's per-node cycles (``profiling_level=detailed``) laid end to end
  inside the launch, widths proportional to cycles (the x86 HTP is a software model, so its
  cycles are the device's count but its wall time is not the device's).

QNN writes one CSV per session and appends one block per run; run *k* of a graph's CSV is
its *k*-th launch.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

from npumoe.core.io import atomic_write_text
from npumoe.core.outputs import OutputKind, claim, json_object

RUN_START = "Accelerator (execute) time (cycles)"
RUN_END = "QNN (execute) time"
THREADS = {"Host": 1, "HTP graphs": 2, "HTP ops": 3}
KIND = "npumoe.Trace"  # in otherData, where trace viewers keep what they do not read
TRACE = OutputKind("an npumoe trace", directory=False,
                   recognise=lambda path: (json_object(path).get("otherData") or {}).get("kind") == KIND)


@dataclass
class HtpRun:
    cycles: int = 0
    execute_us: int = 0
    nodes: list[tuple[str, int]] = field(default_factory=list)


def read_profile(path: Path) -> list[HtpRun]:
    """The runs in one session's QNN profile CSV, in order."""
    runs: list[HtpRun] = []
    current = None
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            what, value = row["Event Identifier"], int(float(row["Time"]))
            if what == RUN_START:
                current = HtpRun(cycles=value)
            elif current is not None and row["Message"] == "NODE":
                current.nodes.append((what.removesuffix(" (cycles)"), value))
            elif current is not None and what == RUN_END:
                current.execute_us = value
                runs.append(current)
                current = None
    return runs


def htp_executors(engine) -> list:
    from npumoe.backends.qualcomm_htp.executor import HtpExecutor

    return [e for e in engine.executors.resident() if isinstance(e, HtpExecutor) and e.profile_csv is not None]


def graph_cycles(engine) -> dict[str, dict]:
    """Per profiled graph: launches and mean accelerator cycles per launch."""
    out = {}
    for ex in htp_executors(engine):
        runs = read_profile(ex.profile_csv) if Path(ex.profile_csv).exists() else []
        if runs:
            out[ex.graph_name] = {"launches": len(runs), "mean_cycles": sum(r.cycles for r in runs) // len(runs),
                                  "mean_execute_us": sum(r.execute_us for r in runs) // len(runs)}
    return out


def chrome_trace(engine) -> dict:
    spans = engine.metrics_.spans or []
    launches = [(ex, run, span) for ex in htp_executors(engine)
                for run, span in zip(read_profile(ex.profile_csv) if Path(ex.profile_csv).exists() else [],
                                     ex.launches)]
    origin = min([s for _, s, _ in spans] + [span[0] for _, _, span in launches], default=0.0)

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    events = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}}
              for name, tid in THREADS.items()]
    events += [{"ph": "X", "name": op, "cat": "host", "pid": 1, "tid": THREADS["Host"],
                "ts": us(a), "dur": us(b) - us(a)}
               for op, a, b in spans]
    for ex, run, (a, b) in launches:
        events.append({"ph": "X", "name": ex.graph_name, "cat": "htp", "pid": 1, "tid": THREADS["HTP graphs"],
                       "ts": us(a), "dur": us(b) - us(a),
                       "args": {"accelerator_cycles": run.cycles, "qnn_execute_us": run.execute_us}})
        total = sum(c for _, c in run.nodes) or 1
        ts = us(a)
        for node, cycles in run.nodes:
            dur = (us(b) - us(a)) * cycles / total
            events.append({"ph": "X", "name": node, "cat": "htp_op", "pid": 1, "tid": THREADS["HTP ops"],
                           "ts": round(ts, 3), "dur": round(dur, 3),
                           "args": {"cycles": cycles, "graph": ex.graph_name}})
            ts += dur
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"kind": KIND, "htp_graph_cycles": graph_cycles(engine)}}


def write_trace(path: str | Path, engine) -> Path:
    return atomic_write_text(claim(path, TRACE, "--trace"), json.dumps(chrome_trace(engine)))
