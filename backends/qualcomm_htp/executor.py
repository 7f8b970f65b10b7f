"""Run one compiled graph (an EPContext model) on the HTP: IR tensors in, IR tensors out.

The only translation at the boundary is the attention mask (``Role.MASK``): the engine masks with −inf,
which fp16 and 16-bit fixed point cannot carry through ``logits + mask``; the HTP gets
``MASK_FLOOR`` instead (exp(−10⁴) is 0 in every precision, so softmax is unchanged).
Calibration feeds go through the same :func:`encode`, so QDQ ranges see what runs.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
import torch

from npumoe.core.ir.backend import check_feed
from npumoe.core.ir.graph import Graph, Role

MASK_FLOOR = -1e4


def encode(graph: Graph, inputs: Mapping[str, torch.Tensor], names=None) -> dict[str, np.ndarray]:
    """The HTP's feed of ``names`` (default: every input a stateless executor takes), masks floored."""
    feed = {}
    for name in graph.stateless_inputs() if names is None else names:
        arr = inputs[name].detach().float().numpy()
        feed[name] = np.maximum(arr, MASK_FLOOR) if graph.inputs[name].role == Role.MASK else np.ascontiguousarray(arr)
    return feed


class HtpExecutor:
    """One graph's session. ``launches`` (host start/end, perf_counter seconds) is kept when
    profiling, so the HTP's per-run profile can be placed on the host timeline."""

    keeps_state = False

    def __init__(self, session, graph: Graph, profile_csv=None):
        self.session, self.graph, self.profile_csv = session, graph, profile_csv
        self.graph_name = graph.name
        self.inputs = [i.name for i in session.get_inputs()]
        self.outputs = [o.name for o in session.get_outputs()]
        self.launches: list[tuple[float, float]] = []

    def __call__(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        check_feed(self.graph, inputs, keeps_state=False, static=True)
        feed = encode(self.graph, inputs, self.inputs)
        start = time.perf_counter()
        raw = self.session.run(self.outputs, feed)
        if self.profile_csv is not None:
            self.launches.append((start, time.perf_counter()))
        return {name: torch.from_numpy(arr) for name, arr in zip(self.outputs, raw)}

    def close(self) -> None:
        """Free the session, and with it the QNN context the HTP holds for it."""
        self.session = None
