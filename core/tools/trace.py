"""``npumoe generate --trace``: one Chrome-trace timeline (chrome://tracing, Perfetto) of a run.

The ``Host`` thread holds the engine's timed host steps (embed, routing, gather, attention, …) from
:class:`~npumoe.core.runtime.metrics.Metrics` spans; a target that can profile its device adds its own
threads through its plugin's :class:`~npumoe.core.ir.backend.DeviceTrace` (the HTP: every graph launch with
its accelerator cycles, and each launch's ops).
"""

from __future__ import annotations

import json
from pathlib import Path

from npumoe.core.base.io import write_output
from npumoe.core.base.outputs import OutputKind, json_object
from npumoe.core.ir.backend import DeviceTrace, plugin, plugin_object

KIND = "npumoe.Trace"  # in otherData, where trace viewers keep what they do not read
TRACE = OutputKind("an npumoe trace", directory=False,
                   recognise=lambda path: (json_object(path).get("otherData") or {}).get("kind") == KIND)
HOST = "Host"


def device_trace(target: str) -> DeviceTrace | None:
    """The target's device profile, if its plugin offers one."""
    record = plugin(target)
    return plugin_object(record, record.trace)() if record.trace else None


def chrome_trace(engine, device: DeviceTrace | None = None, device_engine=None) -> dict:
    """``engine``'s host spans and ``device``'s profile of ``device_engine`` (default: ``engine``; under
    disaggregated generation, the prefill engine whose target was profiled)."""
    host = [(HOST, op, "host", a, b, {}) for op, a, b in engine.metrics_.spans or []]
    device_spans, other = device.spans(device_engine or engine) if device else ([], {})
    spans = host + device_spans
    origin = min((start for _, _, _, start, _, _ in spans), default=0.0)
    threads = {name: tid for tid, name in enumerate(dict.fromkeys([HOST] + [s[0] for s in device_spans]), 1)}

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    events = [{"ph": "M", "name": "thread_name", "pid": 1, "tid": tid, "args": {"name": name}}
              for name, tid in threads.items()]
    events += [{"ph": "X", "name": name, "cat": category, "pid": 1, "tid": threads[thread], "ts": us(start),
                "dur": round(us(end) - us(start), 3), **({"args": args} if args else {})}
               for thread, name, category, start, end, args in spans]
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"kind": KIND, **other}}


def write_trace(path: str | Path, engine, device: DeviceTrace | None = None, device_engine=None) -> Path:
    return write_output(path, TRACE, json.dumps(chrome_trace(engine, device, device_engine)), "--trace")
