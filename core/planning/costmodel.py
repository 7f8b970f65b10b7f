"""Estimated tokens/s of a planned model on phone and laptop NPUs: a roofline with launch costs.

Decode reads every weight a token touches once, so a decode step costs its weight bytes over the
device's DRAM bandwidth plus one launch cost per graph it runs; prefill does ~2 FLOPs per active
parameter per token, so a chunk costs the larger of its compute time at the NPU's peak and its weight
traffic, plus its launches. Every device number carries its public source; a number nobody published
(launch costs) says so. These are estimates, labelled as such wherever they are shown, and
each backend's plugin record holds figures the model was not fitted to (``BackendPlugin.published``), so
``npumoe compare`` prints how far off it is — a cost model nobody checks is a guess. The devices themselves
come from the plugin records too (``BackendPlugin.devices``): core names no target.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from npumoe.core.ir.backend import Device, plugins


@dataclass(frozen=True)
class Workload:
    """What one token costs a planned model, from its plan and spec (see :func:`npumoe.core.tools.targets`)."""

    decode_weight_bytes: float  # weights one decode token reads (dense graphs + the experts it hits)
    decode_launches: float  # graph launches per decode step
    prefill_flops_per_token: float  # 2 x active parameters
    chunk: int
    chunk_weight_bytes: float  # weights one prefill chunk reads
    chunk_launches: float  # graph launches per prefill chunk


@dataclass(frozen=True)
class Estimate:
    device: str
    decode_tok_s: float
    prefill_tok_s: float


def launch_seconds(device: Device, flops: float, weight_bytes: float, launches: float = 1.0) -> float:
    """Graph launches that do ``flops`` and read ``weight_bytes`` between them: the larger of compute at the NPU's
    peak and weight traffic at its DRAM bandwidth, plus each launch's cost."""
    compute, traffic = flops / (device.npu_tops * 1e12), weight_bytes / (device.dram_gb_s * 1e9)
    return max(compute, traffic) + launches * device.launch_us * 1e-6


def estimate(device: Device, work: Workload) -> Estimate:
    decode = launch_seconds(device, 0.0, work.decode_weight_bytes, work.decode_launches)
    chunk = launch_seconds(device, work.chunk * work.prefill_flops_per_token, work.chunk_weight_bytes,
                           work.chunk_launches)
    return Estimate(device.name, 1 / decode, work.chunk / chunk)


def devices(target: str | None = None) -> list[tuple[str, Device]]:
    """(target, device) for every device the installed backends run on, or only ``target``'s."""
    return [(name, device) for name, record in plugins().items() if target in (None, name) for device in record.devices]


def check_published() -> list[dict]:
    """Each published figure beside the model's estimate for the same workload: estimate / published."""
    rows = []
    for record in plugins().values():
        for fig in record.published:
            device = next(d for d in record.devices if d.name == fig.device)
            work = Workload(fig.weight_bytes_per_token, fig.launches_per_token, 0.0, 1, fig.weight_bytes_per_token,
                            fig.launches_per_token)
            est = estimate(device, work).decode_tok_s
            rows.append({"target": record.name, "device": fig.device, "label": fig.label,
                         "assumptions": fig.assumptions, "published_tok_s": fig.decode_tok_s,
                         "estimate_tok_s": est, "ratio": est / fig.decode_tok_s, "source": fig.source})
    return rows


def workload(spec, plan, chunk_launches: float) -> Workload:
    """A planned model's per-token costs at fp16 weights: dense graphs, and the expert graphs a decode token
    launches (whole, as the plan cut them: its expected figures; the top-k experts in plans made before); a
    prefill chunk reads every expert (at real chunk sizes nearly all are hit) and launches what was measured
    (``chunk_launches``)."""
    from npumoe.core.ir.weights import expected_shapes
    from npumoe.core.planning.plan import expert_bytes

    params = {n: float(np.prod(s)) for n, s in expected_shapes(spec).items() if n != "embed.weight"}
    params.setdefault("lm_head.weight", float(spec.vocab_size * spec.hidden_size))  # a tied head is still read
    dense = 2 * sum(p for n, p in params.items() if ".moe.experts." not in n)
    every = sum(spec.layers[i].ffn.num_experts * expert_bytes(spec, i) for i in spec.moe_layers)
    hit = expert_launches = 0.0
    for i, lp in plan.layers.items():
        if "decode_weight_mb" in lp.predicted:
            hit += lp.predicted["decode_weight_mb"] * 1e6
            expert_launches += lp.predicted["decode_launches"]
        else:
            hit += spec.layers[i].ffn.top_k * expert_bytes(spec, i)
            expert_launches += min(spec.layers[i].ffn.top_k, sum(g.residency == "npu" for g in lp.groups))
    return Workload(decode_weight_bytes=dense + hit, decode_launches=spec.num_layers + 1 + expert_launches,
                    prefill_flops_per_token=dense + hit,  # 2 FLOPs per active parameter = its fp16 bytes
                    chunk=plan.chunk, chunk_weight_bytes=dense + every, chunk_launches=chunk_launches)
