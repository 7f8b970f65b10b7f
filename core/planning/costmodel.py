"""Estimated tokens/s of a planned model on phone and laptop NPUs: a roofline with launch costs.

The budget side (:func:`footprint`, :func:`verdict`) asks whether a build fits a device at all: its weights at
the build's precision, the KV cache at its context and its activations, against the share of the device's RAM
one app may hold, and each package or context binary against the most one may hold.

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

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from npumoe.core.base.errors import InputError
from npumoe.core.ir.backend import Device, plugin, plugin_object, plugins
from npumoe.core.ir.graph import Role


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


REQUESTS = (("prefill-heavy", 2048, 128), ("decode-heavy", 128, 1024))  # (label, prompt tokens, new tokens)
HANDOFF_BYTES = 3  # per fp16 cache byte: read once from the prefill device, written once in fp32 for decode
SPLIT_ASSUMPTIONS = (
    "prefill on the chip's device with the most compute (its records' peak ops/s), decode on the one estimated "
    "to decode fastest",
    "each phase at its device's estimated tokens/s from this build's own plan for that target (roofline, constant "
    "with position: attention's growth with context is not modelled)",
    f"hand-off: the prompt's fp16 KV cache read once and written once in fp32 ({HANDOFF_BYTES} bytes moved per "
    "cached byte) at the chip's DRAM bandwidth, in series between prefill and decode; both engines' weights "
    "resident at once (the memory verdicts count one target's)",
    "a target alone: the same request, prefill and decode on that target's device of the chip",
)


def disaggregated(estimates: dict[str, dict[str, dict]], kv_bytes_per_token: float) -> list[dict]:
    """Per chip that carries devices of two built targets (``estimates``: target → device name → its
    ``prefill_tok_s`` and ``decode_tok_s``): the prompt on the device with the most compute (a real model's prefill
    is compute-bound), decode on the one estimated to decode fastest, where those are different targets; each of
    :data:`REQUESTS` timed that way and its speed-up over each target alone (below 1 where the split does not pay,
    as on a model small enough to be launch-bound; the assumptions: :data:`SPLIT_ASSUMPTIONS`)."""
    by_chip: dict[str, list[tuple[str, Device, dict]]] = {}
    for target, device in devices():
        if device.chip and device.name in estimates.get(target, {}):
            by_chip.setdefault(device.chip, []).append((target, device, estimates[target][device.name]))
    rows = []
    for chip, options in by_chip.items():
        prefill = max(options, key=lambda o: o[1].npu_tops)
        decode = max(options, key=lambda o: o[2]["decode_tok_s"])
        if prefill[0] == decode[0]:
            continue
        handoff = HANDOFF_BYTES * kv_bytes_per_token / (min(prefill[1].dram_gb_s, decode[1].dram_gb_s) * 1e9)
        requests = []
        for label, prompt, new in REQUESTS:
            split = prompt / prefill[2]["prefill_tok_s"] + prompt * handoff + new / decode[2]["decode_tok_s"]
            alone = {t: prompt / e["prefill_tok_s"] + new / e["decode_tok_s"] for t, _, e in options}
            requests.append({"request": label, "prompt": prompt, "new": new, "seconds": split,
                             "handoff_seconds": prompt * handoff,
                             "speedup": {t: seconds / split for t, seconds in alone.items()}})
        rows.append({"chip": chip,
                     "prefill": {"target": prefill[0], "device": prefill[1].name,
                                 "tok_s": prefill[2]["prefill_tok_s"]},
                     "decode": {"target": decode[0], "device": decode[1].name, "tok_s": decode[2]["decode_tok_s"]},
                     "handoff_seconds_per_token": handoff, "requests": requests,
                     "assumptions": list(SPLIT_ASSUMPTIONS)})
    return rows


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


def decode_experts(spec, plan, layer: int) -> tuple[float, float | None]:
    """(fp16 expert bytes a decode token reads in MoE layer ``layer``, the expert graphs it launches): the plan's
    predicted figures (its graphs read whole), else — no plan, or one made before predictions — the top-k experts'
    bytes and None (the launches are the caller's to count)."""
    from npumoe.core.planning.plan import expert_bytes

    predicted = plan.layers[layer].predicted if plan is not None else {}
    if "decode_weight_mb" in predicted:
        return predicted["decode_weight_mb"] * 1e6, predicted["decode_launches"]
    return float(spec.layers[layer].ffn.top_k * expert_bytes(spec, layer)), None


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
        read, launches = decode_experts(spec, plan, i)
        hit += read
        expert_launches += launches if launches is not None else min(spec.layers[i].ffn.top_k,
                                                                       sum(g.residency == "npu" for g in lp.groups))
    return Workload(decode_weight_bytes=dense + hit, decode_launches=spec.num_layers + 1 + expert_launches,
                    prefill_flops_per_token=dense + hit,  # 2 FLOPs per active parameter = its fp16 bytes
                    chunk=plan.chunk, chunk_weight_bytes=dense + every, chunk_launches=chunk_launches)


# -- what a build needs of a device's memory ---------------------------------------------------------------
HOST_BITS = 16.0  # weights the host runs itself (embedding, router, norms, CPU experts): as stored (bf16)
CACHE_BYTES = 2  # the KV cache and activations cross to the NPU in fp16


@dataclass(frozen=True)
class Footprint:
    """What a planned build holds in memory while it runs, in bytes (JSON-able: a multi-target manifest keeps
    it). Package weights count every copy, as the build stores them: with one QNN context a graph, a layer's
    prefill and decode graphs hold a copy each; in a Core ML package, graphs reading the same weights share
    one, but a group's prefill graph and its per-expert decode graphs read different sets and hold two."""

    precision: str
    max_context: int
    package_weight_bytes: float  # in the NPU's packages or context binaries
    host_weight_bytes: float  # what the host maps for the graphs it runs
    kv_bytes: float  # the KV cache at max_context
    activation_bytes: float  # the largest graph's inputs and outputs, the cache aside
    graphs: int  # compiled graphs loaded (QNN contexts, Core ML functions): graphs sharing weights count once
    largest_graph: str  # the one holding the most weights, which a package must hold whole
    largest_graph_bytes: float

    @property
    def bytes(self) -> float:
        return self.package_weight_bytes + self.host_weight_bytes + self.kv_bytes + self.activation_bytes


def weight_bits(target: str, precision: str) -> Callable[[str], float]:
    """Graph kind → bits one stored weight takes in ``target``'s build at ``precision`` (its plugin's rule)."""
    record = plugin(target)
    if record.weight_bits is None:
        if precision != "fp16":
            raise InputError(f"target {target} builds fp16 weights only, not {precision!r}.")
        return lambda kind: 16.0
    bits = plugin_object(record, record.weight_bits)
    bits("experts", precision)  # an unknown precision fails here, naming the choices
    return lambda kind: bits(kind, precision)


def stored_units(graphs: list, shares: bool) -> list[list]:
    """The graphs as a build stores them: each alone, or, on a target whose graphs share weights, together with every
    graph they share any weight with (a group's prefill graph and the decode graphs cut from it go into one package
    or context, their weights once)."""
    if not shares:
        return [[g] for g in graphs]
    owner: dict[str, int] = {}  # weight → the unit holding it
    units: list[list] = []
    for g in graphs:
        linked = sorted({owner[n] for n in g.weight_names() if n in owner})
        into = linked[0] if linked else len(units)
        if not linked:
            units.append([])
        for other in linked[1:]:  # g joins units that were apart
            for moved in units[other]:
                owner.update(dict.fromkeys(moved.weight_names(), into))
            units[into] += units[other]
            units[other] = []
        units[into].append(g)
        owner.update(dict.fromkeys(g.weight_names(), into))
    return [u for u in units if u]


def footprint(spec, plan, max_context: int, precision: str = "fp16") -> Footprint:
    """What ``plan``'s build for its target at ``precision`` holds in memory at ``max_context``."""
    from npumoe.core.compiler.program import build_program
    from npumoe.core.ir.weights import expected_shapes

    bits, shares = weight_bits(plan.target, precision), plugin(plan.target).shares_weights
    shapes = expected_shapes(spec) | {"lm_head.weight": (spec.vocab_size, spec.hidden_size)}  # tied or not
    program = build_program(spec, chunk=plan.chunk, max_context=max_context, plan=plan)
    npu = [g for g in program.graphs.values() if g.placement == "npu"]
    compiled = {}  # stored unit → (its weight bytes, a graph of it)
    for unit in stored_units(npu, shares):
        held = {}  # each weight once, at the bits of the first graph holding it
        for g in unit:
            for n in g.weight_names():
                held.setdefault(n, g.kind)
        compiled[unit[0].name] = (sum(bits(kind) / 8 * math.prod(shapes[n]) for n, kind in held.items()), unit[0].name)
    on_npu = {n for g in npu for n in g.weight_names()}
    host = HOST_BITS / 8 * sum(math.prod(s) for n, s in expected_shapes(spec).items() if n not in on_npu)
    caches = {(g.layer, n): t.shape for g in program.graphs.values() for n, t in g.inputs.items()
              if t.role == Role.KV_CACHE}  # a layer's prefill and decode graphs read one cache
    activations = max(sum(math.prod(t.shape) for t in [*g.inputs.values(), *g.outputs.values()]
                          if t.role != Role.KV_CACHE) for g in program.graphs.values())
    largest = max(compiled.values(), default=(0.0, "-"))
    return Footprint(precision, max_context, sum(size for size, _ in compiled.values()), host,
                     CACHE_BYTES * sum(math.prod(s) for s in caches.values()), CACHE_BYTES * activations,
                     len(compiled), largest[1], largest[0])


@dataclass(frozen=True)
class Verdict:
    """Whether a build fits a device: memory against the share one app may hold, packages against their limit."""

    device: str
    needed_bytes: float  # the footprint plus each compiled graph's overhead
    budget_bytes: float
    ram_gb: float
    largest_graph_bytes: float
    package_limit_bytes: float | None

    @property
    def memory_over(self) -> float:
        return max(0.0, self.needed_bytes - self.budget_bytes)

    @property
    def package_over(self) -> float:
        return 0.0 if self.package_limit_bytes is None else max(0.0, self.largest_graph_bytes
                                                                - self.package_limit_bytes)

    @property
    def fits(self) -> bool:
        return not (self.memory_over or self.package_over)

    @property
    def line(self) -> str:
        """e.g. "Apple A17 Pro ✓: 3.1 GB of the 4.0 GB an app may hold (8 GB RAM), packages ≤ 1 GB": the verdict
        beside the device, not after its last clause (which it would seem to judge alone)."""
        memory = f"{size(self.needed_bytes)} of the {size(self.budget_bytes)} an app may hold ({self.ram_gb:g} GB RAM)"
        if self.memory_over:
            memory += f", {size(self.memory_over)} over"
        if self.package_limit_bytes is None:
            package = ""
        elif self.package_over:
            package = f", largest graph {size(self.largest_graph_bytes)}: {size(self.package_over)} over the " \
                      f"{size(self.package_limit_bytes)} limit"
        else:
            package = f", packages ≤ {size(self.package_limit_bytes)}"
        return f"{self.device} {'✓' if self.fits else '✗'}: {memory}{package}"

    def to_json(self) -> dict:
        return {"device": self.device, "fits": self.fits, "needed_bytes": self.needed_bytes,
                "budget_bytes": self.budget_bytes, "ram_gb": self.ram_gb,
                "largest_graph_bytes": self.largest_graph_bytes, "package_limit_bytes": self.package_limit_bytes,
                "line": self.line}


def size(n: float) -> str:
    """Bytes for a verdict: GB to a tenth from 1 GB ("1 GB", not "1.0 GB"), MB below."""
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB".replace(".0 GB", " GB")
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e6:.2f} MB"


def verdict(device: Device, need: Footprint) -> Verdict | None:
    """``need`` against ``device`` (None: its record gives no memory figures)."""
    if device.ram_gb is None:
        return None
    limit = None if device.max_package_gb is None else device.max_package_gb * 1e9
    return Verdict(device.name, need.bytes + need.graphs * device.graph_overhead_mb * 1e6,
                   device.ram_gb * device.app_share * 1e9, device.ram_gb, need.largest_graph_bytes, limit)


def verdicts(target: str, need: Footprint) -> list[Verdict]:
    """``need`` against every device ``target`` runs on that says what it can hold."""
    return [v for _, d in devices(target) if (v := verdict(d, need)) is not None]


def budget_lines(target: str, need: Footprint) -> list[str]:
    """One line per device, and when none fits, which limit is nearest to holding it and by how much."""
    found = verdicts(target, need)
    lines = [v.line for v in found]
    if found and not any(v.fits for v in found):
        near = min(found, key=lambda v: (v.memory_over, v.package_over))
        why = [f"is {size(near.memory_over)} short of memory"] if near.memory_over else []
        why += [f"takes packages of {size(near.package_limit_bytes)}, {size(near.package_over)} less than the "
                "largest graph"] if near.package_over else []
        lines.append(f"fits no {target} device at {need.precision}: the nearest, {near.device}, {' and '.join(why)}")
    return lines
