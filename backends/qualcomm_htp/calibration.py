"""Activation samples for QDQ ranges, captured from the reference program on calibration text.

The reference engine (fp32, CPU) runs the planned program exactly as deployment will:
chunked prefill of the text in windows that fit the compiled KV length, then greedy decode
steps so the single-token graphs are seen too. NPU graphs' inputs are recorded as the HTP
will receive them (:func:`~npumoe.backends.qualcomm_htp.executor.encode`).

Expert groups are the exception. Their recorded buffers are mostly zero padding, and a
cold expert may receive no token at all, leaving its slice of the graph with an empty range
(every value then saturates). Each expert group is instead calibrated on buffers filled with
its layer's real FFN inputs (the attention graphs' ``z`` rows): every expert sees the
activations it could be routed.
"""

from __future__ import annotations

import numpy as np
import torch

from npumoe.backends.qualcomm_htp.executor import encode
from npumoe.core.base.errors import InputError

DEFAULT_TOKENS = 256
DECODE_STEPS = 16
PER_GRAPH = 16


def default_text() -> str:
    from npumoe.core.runtime.calibrate import default_calibration_texts

    return "".join(default_calibration_texts().values())


def _windows(ids: list[int], chunk: int, size: int, tokens: int) -> list[list[int]]:
    size = max(chunk, size // chunk * chunk)
    return [ids[s:s + size] for s in range(0, min(len(ids), tokens), size) if len(ids) - s >= chunk]


def _filled(pool: torch.Tensor, rows: int, count: int) -> list[dict[str, np.ndarray]]:
    """``count`` buffers of ``rows`` real token rows, drawn without repeats while the pool lasts."""
    order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(0))
    take = order.repeat(-(-rows * count // len(pool)))[:rows * count]
    return [{"x": pool[take[k * rows:(k + 1) * rows]].numpy()} for k in range(count)]


def capture(model, plan, max_context: int, names: list[str], text: str | None = None,
            tokens: int = DEFAULT_TOKENS, per_graph: int = PER_GRAPH) -> dict[str, list[dict[str, np.ndarray]]]:
    """Graph name → input feeds for the NPU graphs ``names``."""
    from npumoe.core.runtime.engine import Engine

    engine = Engine(model, plan, max_context=max_context)
    program = engine.program
    ids = model.tokenizer.encode(text if text is not None else default_text())
    windows = _windows(ids, plan.chunk, max_context - DECODE_STEPS, tokens)
    if not windows:
        raise InputError(
            f"QDQ calibration needs at least {plan.chunk} tokens of text and a KV length above "
            f"{plan.chunk + DECODE_STEPS} (got {len(ids)} tokens, max_context {max_context}); give more text or a "
            "larger --max-context."
        )
    samples: dict[str, list[dict[str, np.ndarray]]] = {n: [] for n in names}
    z_rows: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(program.layers))}
    attention = {program.layers[i].attention[s]: i for i in z_rows for s in program.seqs}

    def recording(name, run):
        graph = program.graphs[name]

        def call(inputs):
            out = run(inputs)
            if name in samples and len(samples[name]) < per_graph:
                samples[name].append(encode(graph, inputs))
            if name in attention:
                z_rows[attention[name]].append(out["z"])
            return out

        call.keeps_state = run.keeps_state
        return call

    for name in {*names, *attention}:
        engine.executors[name] = recording(name, engine.executors[name])
    engine.generate(np.asarray(windows[0]), max_new_tokens=DECODE_STEPS)
    # generating runs the LM head on the prompt's last row only: the chunk-wide heads see a prompt through forward()
    for window in windows[1:] or windows[:1]:
        engine.forward(np.asarray(window))
    for name in names:
        graph = program.graphs[name]
        if graph.kind == "experts":
            samples[name] = _filled(torch.cat(z_rows[graph.layer]), graph.inputs["x"].shape[0], per_graph)
    return samples
