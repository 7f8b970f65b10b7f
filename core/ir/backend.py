"""The backend plugin contract and its registry: what porting npumoe to a new NPU means.

A backend package registers one :class:`BackendPlugin` under the ``npumoe.backends`` entry-point
group (the built-in cpu, htp and ane register theirs in npumoe's own pyproject, exactly as a third
party would). The plugin record is cheap to import: it names the device's :class:`Capabilities`
(all the planner knows), the build options the CLI offers, the pip extra that installs the
toolchain, and the ``module:Class`` of the backend itself, imported only when something is built
or run. So `plan` and `--help` never import a toolchain, and core never imports a concrete backend.

A plugin record also carries what the rest of npumoe shows about the device, so porting edits nothing in
npumoe: the cost model's :class:`Device` records for the chips it runs on (each number with its source) and
the :class:`Published` figures that check them, the CLI commands it adds (``npumoe hub``, ``npumoe lint``)
and, optionally, a device profile for ``npumoe generate --trace`` and a :class:`ProgramTarget` for ``npumoe export``.

The backend object (compare ggml's backend vtable) has ``caps``, ``lower(graph, weights, out_dir)``
(compile one static IR graph into an artifact), ``load(artifact, out_dir, graph, weights)`` (an
executor: named input tensors → named output tensors at the graph's static shapes), ``calibrate``,
``build`` and ``describe``; ``npumoe.backends.base.BackendBase`` supplies defaults for the last three.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from npumoe.core.base.errors import BackendUnavailableError, InputError
from npumoe.core.ir.graph import Graph

if TYPE_CHECKING:  # the registry is read by `npumoe --help`: no torch import at module level
    import torch

API_VERSION = 1
"""Bumped whenever the contract below changes incompatibly; a plugin built for another is refused."""

ENTRY_POINT_GROUP = "npumoe.backends"



class Executor(Protocol):
    """One loaded graph: its declared inputs by name → its declared outputs by name, at static shapes.

    ``keeps_state``: the executor holds the KV cache itself (Core ML states, say). The engine then
    passes no ``Role.KV_CACHE`` inputs, only ``Role.POSITION``, and still appends the ``Role.KV_NEW``
    outputs to its own cache (the reference for every other graph). Such an executor also offers
    ``read_cache(name, length) -> [heads, length, dim]`` fp32 tensor: the first positions of its layer's cache
    input ``name`` as its device holds them, which a KV hand-off to another engine reads.
    An executor that holds device memory offers ``close()``, which frees it (residency calls it on eviction)."""

    keeps_state: bool

    def __call__(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


class DeviceMemoryFull(Exception):
    """A backend's ``load`` could not allocate the graph on its device: residency unloads others and retries."""


@dataclass(frozen=True)
class Capabilities:
    """What the planner may assume about a device. Honest numbers, with their source; every field is
    read by the planner (ops and graph bytes decide what the device takes at all; alignment shapes the
    capacities; launch cost and throughput decide which groups pay for a launch; launch cost and weight
    bandwidth decide how many experts a decode graph holds)."""

    name: str
    ops: frozenset[str]  # IR ops its lowering takes (core.ir.OPS); a graph with another op runs on the CPU
    alignment: int = 1  # capacities and channel counts are multiples of this
    max_graph_bytes: int = 1 << 62  # fp16 weight bytes one graph may carry
    dispatch_seconds: float = 0.0  # fixed cost of one launch, host round trip included
    flops_per_second: float = 1e10  # sustained for the expert FFN shapes we emit
    weight_bytes_per_second: float = 5e10  # weights a launch streams from DRAM (decode is bound by it)
    notes: tuple[str, ...] = field(default_factory=tuple)  # shown with every plan for this device

    def align(self, n: int) -> int:
        return -(-n // self.alignment) * self.alignment

    def unsupported(self, graph: Graph, weight_bytes: int) -> str | None:
        """Why this device cannot take ``graph`` (None: it can), from what it claims: ops, then size."""
        missing = sorted({op.op for op in graph.ops} - self.ops)
        if missing:
            return f"{self.name} does not take the op{'s' * (len(missing) > 1)} {', '.join(missing)}"
        if weight_bytes > self.max_graph_bytes:
            return (f"its {weight_bytes / 1e9:.2f} GB of weights exceed the {self.max_graph_bytes / 1e9:.2f} GB "
                    f"one {self.name} graph may hold")
        return None


def check_feed(graph: Graph, inputs: Mapping[str, torch.Tensor], *, keeps_state: bool, static: bool) -> None:
    """Refuse a feed missing an input the executor reads, or (``static``: a compiled graph) holding one of
    another shape, naming it: a device would fail deep in its runtime, or read the wrong bytes."""
    from npumoe.core.ir.graph import Role

    for name, declared in graph.inputs.items():
        if declared.role == (Role.KV_CACHE if keeps_state else Role.POSITION):
            continue  # held as state / read only by stateful executors
        if name not in inputs:
            raise InputError(f"graph {graph.name} needs its {declared.role.value} input {name!r} "
                             f"{list(declared.shape)}, which was not given.")
        got = tuple(inputs[name].shape)
        if static and got != declared.shape:
            raise InputError(f"graph {graph.name}'s input {name!r} has shape {list(got)}, but it was compiled "
                             f"for {list(declared.shape)}.")


@dataclass(frozen=True)
class Lowered:
    """What lowering one graph produced (compare ExecuTorch's PreprocessResult): its artifact format, the
    files written under the output directory (the manifest hashes them), and the backend's own JSON-able
    fields that ``load`` reads back. The manifest stores it flat (:meth:`to_entry`); ``load`` gets it back
    as this record, with the build's own fields (kind, sizes, timings) among ``info``."""

    format: str
    files: tuple[str, ...] = ()
    info: Mapping[str, Any] = field(default_factory=dict)

    def to_entry(self) -> dict[str, Any]:
        return {**self.info, "format": self.format, "files": list(self.files)}

    @classmethod
    def from_entry(cls, entry: Mapping[str, Any]) -> Lowered:
        info = {k: v for k, v in entry.items() if k not in ("format", "files")}
        return cls(str(entry.get("format")), tuple(entry.get("files", ())), info)


@dataclass(frozen=True)
class BuildOption:
    """One option a backend's build takes; the CLI offers it as ``--NAME`` (``flag``: an on/off switch)."""

    name: str
    help: str
    choices: tuple[str, ...] | None = None
    flag: bool = False

    @property
    def flag_name(self) -> str:
        return "--" + self.name.replace("_", "-")


@dataclass(frozen=True)
class Conformance:
    """What the conformance suite holds a backend to: its declared accuracy against the reference
    interpreter, and the checks it is excused from, each with the reason (listed, never hidden)."""

    min_cosine: float = 0.9999  # of every output against the interpreter's
    max_relative_error: float = 1e-4  # max |Δ| / max |reference| per output
    skips: tuple[tuple[str, str], ...] = ()  # (check id, reason)


# fp16 between ops (the ANE, the HTP, an NPU's default): npumoe conformance measured at most 2.1e-3 relative error on
# the demo's graphs
FP16_CONFORMANCE = Conformance(min_cosine=0.9999, max_relative_error=5e-3)

UNPUBLISHED_LAUNCH = "no public figure: npumoe's order-of-magnitude estimate (see the backend's Capabilities)"


@dataclass(frozen=True)
class Device:
    """A chip a target runs on, as the cost model (:mod:`npumoe.core.planning.costmodel`) reads it: its speed,
    and what it can hold (the memory fields: None where nothing is known, and then no verdict is given)."""

    name: str
    npu_tops: float  # peak tera-ops/s (NPUs: int8 for Qualcomm, Apple's fp16 as marketed; a GPU: FP32 TFLOPS)
    dram_gb_s: float  # what the accelerator can stream from DRAM
    launch_us: float  # one graph launch, host round trip included
    sources: tuple[tuple[str, str], ...]  # (field, where the number comes from)
    ram_gb: float | None = None  # RAM of the phone or Mac its source names (the chip ships with several)
    app_share: float = 1.0  # of that RAM, what one app may hold
    max_package_gb: float | None = None  # weights one package (Core ML) or context binary (QNN) may hold
    graph_overhead_mb: float = 0.0  # what each loaded compiled graph (QNN context, Core ML function) costs beyond
    # its weights
    chip: str | None = None  # the SoC it is part of: devices of one chip (a Mac's ANE and GPU) can split a request,
    # prefill on one and decode on the other (npumoe compare's disaggregated rows)

    def source(self, field: str) -> str:
        return dict(self.sources)[field]


@dataclass(frozen=True)
class Published:
    """A figure someone measured on a :class:`Device`, and the workload it implies, to hold the cost model
    against (it was not fitted to it)."""

    device: str
    label: str
    assumptions: str  # what the workload below takes the figure to mean
    decode_tok_s: float
    weight_bytes_per_token: float
    launches_per_token: float
    source: str


EXPERT_REGION = {"npumoe_region": "experts"}
"""What ``npumoe export`` annotates (``torch.fx.traceback.annotate``, a node's ``meta["custom"]``) on the nodes of the
expert products, so a target's lowering can hand its device exactly those."""


def is_expert_product(node) -> bool:
    """Whether a traced node (a torch.fx node) is one of the expert products :data:`EXPERT_REGION` marks."""
    return EXPERT_REGION.items() <= (node.meta.get("custom") or {}).items()


@dataclass(frozen=True)
class RunnerSetup:
    """What the native runner does before it loads a program, for the target's delegate to find its device libraries:
    environment variables it sets where unset, then shared libraries it loads globally, in order (absolute paths)."""

    env: Mapping[str, str] = field(default_factory=dict)
    preload: tuple[str, ...] = ()


@dataclass(frozen=True)
class ProgramTarget:
    """How a target takes part in ``npumoe export``'s whole-model ExecuTorch program: how its methods are lowered (the
    partitioners that hand its device the parts it runs) and what the native runner needs for those parts' backends."""

    lower: str  # "module:function": ({method: ExportedProgram}, constant methods) → ExecuTorch's EdgeProgramManager
    libraries: tuple[str, ...] = ()  # ExecuTorch backend libraries the runner links (names without lib and .so)
    device: str = "cpu"  # what runs the program's delegated parts, as the export manifest says
    runner_setup: str | None = None  # "module:function" → the RunnerSetup of this machine (None: nothing to do)
    op_impls: str | None = None  # "module:NAME" → {IR op: implementation} replacing the interpreter's in the program
    expert_dtype: str = "float32"  # the expert products' weights and rows (float16: a device that computes fp16 only
    # is handed fp16 tensors, the casts left on the CPU)
    elsewhere: str | None = None  # where the delegate exists when this machine's ExecuTorch lacks it (the runner says)
    check: str | None = None  # "module:function" (the program's bytes) → None, or raises naming what the device rejects


class DeviceTrace(Protocol):
    """A target's device profile in ``npumoe generate --trace`` (``BackendPlugin.trace`` names its class)."""

    def backend_options(self, trace_path: Path) -> dict[str, Any]:
        """The backend options that make its executors record a profile (beside ``trace_path``)."""
        ...

    def spans(self, engine) -> tuple[list[tuple[str, str, str, float, float, dict]], dict]:
        """After a run: ``(thread, name, category, start_s, end_s, args)`` per device event, on the
        ``time.perf_counter`` clock the engine's host spans use, and a dict for the trace's ``otherData``."""
        ...


@dataclass(frozen=True)
class BackendPlugin:
    """A backend as the registry knows it, without its toolchain imported."""

    name: str
    caps: Capabilities
    factory: str  # "module:Class" of the backend, imported on use
    summary: str  # one line for --help, e.g. "Qualcomm Hexagon NPU through QNN"
    extra: str | None = None  # `pip install npumoe[EXTRA]` installs its toolchain
    options: tuple[BuildOption, ...] = ()
    conformance: Conformance = Conformance()
    api_version: int = API_VERSION
    # A finer, still toolchain-free check than Capabilities.unsupported (e.g. a rule table): (graph,
    # fp16 weight bytes) → None or the reason. The planner places graph by graph with it.
    check: Callable[[Graph, int], str | None] | None = None
    devices: tuple[Device, ...] = ()  # chips it runs on: npumoe compare estimates tokens/s for each
    # "module:function" of (graph kind, precision) → bits one stored weight takes (None: 16 for every precision),
    # and whether graphs reading the same weights share one package (Core ML multifunction) or each holds its
    # own copy (one QNN context a graph): what a build needs of a device's memory (the cost model's budget)
    weight_bits: str | None = None
    shares_weights: bool = False
    # graphs that cannot share weights (one QNN context a graph): the planner then gives each expert group one
    # compiled shape and decodes on it too (Plan.decode "prefill"), so that a build stores every weight once
    one_graph_per_weights: bool = False
    published: tuple[Published, ...] = ()  # measured figures on those chips that check the estimates
    commands: Mapping[str, str] = field(default_factory=dict)  # CLI name → "module:click_command", imported on use
    command_help: Mapping[str, str] = field(default_factory=dict)  # CLI name → its line in `npumoe --help`
    trace: str | None = None  # "module:Class" of its DeviceTrace, if it can profile a run
    program: ProgramTarget | None = None  # how npumoe export puts a whole model on it (None: not yet)

    def supports(self, graph: Graph, weight_bytes: int) -> str | None:
        """None if this backend takes ``graph``, else why not (one clause, for the plan and its table)."""
        return (self.check or self.caps.unsupported)(graph, weight_bytes)


class Backend(Protocol):
    name: str
    caps: Capabilities

    def lower(self, graph: Graph, weights: Mapping[str, torch.Tensor], out_dir: Path) -> Lowered: ...

    def load(self, artifact: Lowered, out_dir: Path, graph: Graph, weights: Mapping[str, torch.Tensor]) -> Executor: ...

    def calibrate(self, model, plan, max_context: int, names: list[str]) -> None: ...

    def build(self, graphs: list[Graph], weights, out_dir: Path, progress: bool | None = None,
              jobs: int = 1) -> dict[str, dict]: ...

    def describe(self) -> dict[str, Any]: ...


@cache
def _registry() -> tuple[dict[str, BackendPlugin], dict[str, str]]:
    """Installed backends by name (cpu first, then alphabetically), and those that failed to register
    with the reason: a broken third-party package is reported when named, not when any command runs."""
    found: dict[str, BackendPlugin] = {}
    broken: dict[str, str] = {}
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: (ep.name != "cpu", ep.name)):
        try:
            record = ep.load()
        except Exception as err:  # any import failure of someone else's package
            broken[ep.name] = f"its plugin {ep.value} failed to import ({err})"
            continue
        if not isinstance(record, BackendPlugin) or record.name != ep.name:
            broken[ep.name] = f"entry point {ep.value} is not a BackendPlugin named {ep.name!r} (see docs/porting.md)"
        elif record.api_version != API_VERSION:
            broken[ep.name] = (f"it was written for npumoe's backend API {record.api_version}, this npumoe has "
                               f"{API_VERSION}; upgrade one of them")
        else:
            found[ep.name] = record
    if "cpu" not in found:
        raise BackendUnavailableError("npumoe's built-in backends are not registered: reinstall it with "
                                      "`pip install -e .` (entry points are package metadata).")
    return found, broken


def plugins() -> dict[str, BackendPlugin]:
    """Every installed, loadable backend by name."""
    return _registry()[0]


def plugin(name: str) -> BackendPlugin:
    found, broken = _registry()
    if name in broken:
        raise BackendUnavailableError(f"backend {name!r} is installed but unusable: {broken[name]}.")
    if name not in found:
        raise InputError(f"unknown target {name!r}; installed: {', '.join(found)}.")
    return found[name]


def capabilities(target: str) -> Capabilities:
    """A target's Capabilities, without importing its toolchain."""
    return plugin(target).caps


def plugin_object(record: BackendPlugin, path: str):
    """What a plugin's ``"module:attribute"`` path names, imported now; a missing toolchain is one line."""
    module, attr = path.split(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        hint = f"; install it with pip install 'npumoe[{record.extra}]'" if record.extra else ""
        raise BackendUnavailableError(f"backend {record.name!r} could not be loaded ({err}){hint}.") from err


def get_backend(name: str, **options) -> Backend:
    """The backend object, its toolchain imported; options are its declared build options."""
    record = plugin(name)
    return plugin_object(record, record.factory)(**options)


def plugin_commands() -> dict[str, tuple[BackendPlugin, str]]:
    """The CLI commands installed backends add: name → (its plugin, "module:click_command")."""
    return {command: (record, path) for record in plugins().values() for command, path in record.commands.items()}
