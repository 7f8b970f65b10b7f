"""Where an exported program decodes by default: on the target's NPU or on the CPU beside it.

In ``npumoe export``'s program the NPU takes the expert products and the CPU everything else, so the two choices
differ only in who streams the experts a decode token hits: the NPU at its weight bandwidth (fp16) plus one launch
per expert graph the step runs, or the CPU at its own (the CPU method keeps them fp32: twice the bytes) with
nothing to launch. Decode is bound by those two costs, so a small model, whose step is all launches, decodes
sooner on the CPU and a real-size one on the NPU (the seed's disaggregated mode). The numbers are the targets'
:class:`~npumoe.core.ir.backend.Capabilities`; the CPU's stand for the phone's or laptop's CPU the program runs on.
"""

from __future__ import annotations

from dataclasses import dataclass

from npumoe.core.ir.backend import capabilities
from npumoe.core.planning.costmodel import decode_experts, size

CPU = "cpu"  # the target a disaggregated program's decode method is lowered for
CPU_BYTES_PER_FP16_BYTE = 2.0  # the CPU method's expert weights are fp32


@dataclass(frozen=True)
class DecodePlacement:
    """The default ``--decode-on`` and the two step times it was chosen from."""

    on: str  # "npu" or "cpu"
    npu_seconds: float
    cpu_seconds: float
    expert_bytes: float  # fp16 expert weights a decode token reads
    launches: float  # expert graphs a decode step launches on the NPU

    def reason(self) -> str:
        return (f"decode on the {self.on}: the cost model gives a decode step's experts "
                f"{1e3 * self.npu_seconds:.3g} ms on the NPU ({size(self.expert_bytes)} at its bandwidth, "
                f"{self.launches:g} launches) against {1e3 * self.cpu_seconds:.3g} ms on the CPU (fp32); "
                f"--decode-on {'npu' if self.on == CPU else 'cpu'} overrides")

    def to_json(self) -> dict:
        return {"on": self.on, "npu_seconds": self.npu_seconds, "cpu_seconds": self.cpu_seconds,
                "expert_bytes": self.expert_bytes, "launches": self.launches, "chosen_by": "cost model"}


def decode_placement(spec, target: str, plan=None) -> DecodePlacement:
    """The cheaper place for ``target``'s program to decode: the plan's expert graphs where there is a plan (its
    predicted bytes and launches a decode step), else each MoE layer's top-k experts in one launch a layer (the
    program's expert region of a layer)."""
    hit = launches = 0.0
    for i in spec.moe_layers:
        read, graphs = decode_experts(spec, plan, i)
        hit, launches = hit + read, launches + (1.0 if graphs is None else graphs)
    npu, cpu = capabilities(target), capabilities(CPU)
    npu_seconds = hit / npu.weight_bytes_per_second + launches * npu.dispatch_seconds
    cpu_seconds = hit * CPU_BYTES_PER_FP16_BYTE / cpu.weight_bytes_per_second
    return DecodePlacement("npu" if npu_seconds <= cpu_seconds else CPU, npu_seconds, cpu_seconds, hit, launches)
