"""``npumoe lint``: check saved Core ML packages against the ANE rule table, on any OS.

Reads each package's spec and weight blob (no Core ML runtime), checks every function
against :mod:`npumoe.backends.apple_ane.rules`, prints a per-function placement table and
fails (exit 2) on any violation, naming the function, the op and the rule. ``npumoe
build --target ane`` runs the same check on every package it writes.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import click
import numpy as np

from npumoe.backends.apple_ane import rules
from npumoe.backends.apple_ane.mlpackage import Package, tensor_spec
from npumoe.core.base.errors import ArtifactError

PACKAGE_SCOPE = "(package)"  # the "function" of a violation that concerns the whole package
COMPRESSION_NAMES = {"constexpr_blockwise_shift_scale": "int4 blocks", "constexpr_lut_to_dense": "palette"}


@dataclass(frozen=True)
class Violation:
    package: str
    function: str
    op: str
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.package}: function {self.function}, op {self.op}: rule {self.rule} ({self.detail})"


@dataclass
class FunctionReport:
    package: str
    function: str
    ops: int
    weight_bytes: int
    states: dict[str, tuple]
    compression: tuple[str, ...]
    violations: list[Violation] = field(default_factory=list)

    @property
    def placement(self) -> str:
        return "ANE" if not self.violations else "CPU/GPU fallback"


def _names(arg) -> list[str]:
    return [b.name for b in arg.arguments if b.WhichOneof("binding") == "name"]


class _FunctionLint:
    """The checks for one function, each appending :class:`Violation` s to ``found``."""

    def __init__(self, package: Package, name: str):
        self.package, self.name = package, name
        self.ops = package.operations(name)
        self.consts = {op.outputs[0].name: op for op in self.ops if op.type == "const"}
        self.found: list[Violation] = []

    def flag(self, op: str, rule: str, detail: str) -> None:
        self.found.append(Violation(self.package.path.name, self.name, op, rules.RULES[rule].id, detail))

    def run(self) -> list[Violation]:
        self.inputs()
        self.states()
        position_path = self.position_path()
        for op in self.ops:
            if op.type == "const":
                continue
            self.op_type(op)
            self.dynamic_index(op, position_path)
            for out in op.outputs:
                self.tensor(op.type, out.name, tensor_spec(out.type), position_path)
        weights = self.package.const_bytes(self.name)
        if weights > rules.MAX_GRAPH_WEIGHT_BYTES:
            limit = rules.MAX_GRAPH_WEIGHT_BYTES
            self.flag("-", "graph-bytes", f"{weights / 1e9:.2f} GB of weights > {limit / 1e9} GB")
        return self.found

    def inputs(self) -> None:
        for name, spec in self.package.inputs(self.name).items():
            if spec.state:
                continue
            if name == rules.POSITION_INPUT and spec.dtype == "INT32":
                continue
            self.tensor("input", name, spec, set())

    def states(self) -> None:
        states = {n: s for n, s in self.package.inputs(self.name).items() if s.state}
        if len(states) > rules.MAX_STATES:
            self.flag("state", "states", f"{len(states)} states > {rules.MAX_STATES}")
        for name, spec in states.items():
            if not spec.static or not rules.state_dims_ok(spec.shape):
                self.flag("state", "states", f"state {name} {list(spec.shape)}: dims after the first must be powers "
                                             f"of two, the last two at least {rules.MIN_STATE_DIM}")
            if spec.dtype != "FLOAT16":
                self.flag("state", "fp16", f"state {name} is {spec.dtype}")

    def position_path(self) -> set[str]:
        """Integer values computed from the ``position`` input: the KV write offset, nothing else."""
        path = {rules.POSITION_INPUT}
        for op in self.ops:
            integer = op.outputs and all(not tensor_spec(o.type).dtype.startswith("FLOAT") for o in op.outputs)
            if integer and any(n in path for a in op.inputs.values() for n in _names(a)):
                path.update(o.name for o in op.outputs)
        return path

    def op_type(self, op) -> None:
        if op.type in rules.REJECTED_OPS:
            self.flag(op.type, "ane-ops", f"the ANE does not run it (NPUMoE Fig. 4: {rules.REJECTED_OPS[op.type]})")
        elif op.type not in rules.ANE_OPS:
            self.flag(op.type, "ane-ops", "not in the ANE op table")
        elif op.type == "conv" and np.any(self.const_value(op, "dilations") != 1):
            self.flag(op.type, "ane-ops", "dilated convolution (NPUMoE Fig. 4)")

    def const_value(self, op, param: str):
        return self.package.value(self.consts[_names(op.inputs[param])[0]].attributes["val"])

    def dynamic_index(self, op, position_path: set[str]) -> None:
        runtime = [p for p, a in op.inputs.items() if p in rules.INDEX_PARAMS and set(_names(a)) - self.consts.keys()]
        if not runtime:
            return
        if op.type == rules.STATE_WRITE_OP and self.feeds_state_write(op) and all(
                set(_names(op.inputs[p])) <= position_path for p in runtime):
            return  # the KV cache write at ``position``
        if op.outputs and all(o.name in position_path for o in op.outputs):
            return  # arithmetic on the offset itself
        self.flag(op.type, "dynamic-index", f"{', '.join(runtime)} computed at run time")

    def feeds_state_write(self, op) -> bool:
        out = op.outputs[0].name
        return any(o.type == "write_state" and out in _names(o.inputs["data"]) for o in self.ops)

    def tensor(self, op: str, name: str, spec, position_path: set[str]) -> None:
        if spec is None:
            return
        if not spec.static:
            self.flag(op, "static-shapes", f"{name} has shape {list(spec.shape)}")
        if spec.dtype.startswith("FLOAT") and spec.dtype != "FLOAT16":
            self.flag(op, "fp16", f"{name} is {spec.dtype}")
        elif not spec.dtype.startswith("FLOAT") and name not in position_path:
            self.flag(op, "fp16", f"{name} is {spec.dtype} and not on the KV write-offset path")
        for axis, size in enumerate(spec.shape):
            limit = rules.axis_limit(len(spec.shape), axis)
            if size is not None and size > limit:
                self.flag(op, "axis-size", f"{name} axis {axis} is {size} > {limit}")


def lint_package(path: str | Path, platform: str = rules.DEFAULT_PLATFORM) -> list[FunctionReport]:
    package = Package(path)
    reports = []
    for name in package.functions:
        found = _FunctionLint(package, name).run()
        states = {n: s.shape for n, s in package.inputs(name).items() if s.state}
        compression = tuple(sorted({op.type for op in package.operations(name) if op.type.startswith("constexpr_")}))
        ops = sum(op.type != "const" for op in package.operations(name))
        reports.append(FunctionReport(package.path.name, name, ops, package.const_bytes(name), states, compression,
                                      found))
    limit = rules.MAX_PACKAGE_BYTES[platform]
    if package.size_bytes > limit:
        violation = Violation(package.path.name, PACKAGE_SCOPE, "-", "package-bytes",
                              f"{package.size_bytes / 1e9:.2f} GB > {limit / 1e9:g} GB on {platform}")
        for r in reports:
            r.violations.append(violation)
    return reports


def violations(reports: list[FunctionReport]) -> list[Violation]:
    return list(dict.fromkeys(v for r in reports for v in r.violations))


def check(path: str | Path, platform: str = rules.DEFAULT_PLATFORM) -> list[FunctionReport]:
    """Lint one package; raise :class:`ArtifactError` naming the first violation."""
    reports = lint_package(path, platform)
    found = violations(reports)
    if found:
        raise ArtifactError(f"{len(found)} ANE rule violation(s); first: {found[0]}.")
    return reports


def check_program(program: bytes) -> None:
    """Every Core ML model an exported program delegates to passes the lint (``npumoe export --target ane``'s check)."""
    from npumoe.backends.apple_ane.pte import core_ml_packages

    with tempfile.TemporaryDirectory() as scratch:
        for package in core_ml_packages(program, Path(scratch)):
            check(package)


def expand(paths, scratch: Path) -> list[Path]:
    """Packages named directly, every package under a directory (an ``npumoe build`` output), or the Core ML models
    of an ExecuTorch program (``npumoe export --target ane``'s ``model.pte``), unpacked under ``scratch``."""
    out = []
    for n, p in enumerate(map(Path, paths)):
        if p.suffix == ".pte":
            from npumoe.backends.apple_ane.pte import core_ml_packages

            (scratch / str(n)).mkdir()
            try:
                found = core_ml_packages(p.read_bytes(), scratch / str(n))
            except ArtifactError:
                raise
            except Exception as err:  # ExecuTorch's deserializer raises its own kinds
                raise ArtifactError(f"{p} is not an ExecuTorch program ({err}); give a model.pte npumoe export "
                                    "wrote.") from err
            if not found:
                raise ArtifactError(f"{p} delegates nothing to Core ML; give a program npumoe export --target ane "
                                    "wrote.")
            out += found
        elif p.is_dir() and p.suffix != ".mlpackage":
            found = sorted(p.rglob("*.mlpackage"))
            if not found:
                raise ArtifactError(f"{p} holds no .mlpackage; give packages or an npumoe build --target ane output.")
            out += found
        else:
            out.append(p)
    return out


def placement_table(reports: list[FunctionReport]):
    from rich.table import Table

    table = Table("package", "function", "ops", "weights", "stored as", "states", "placement",
                  title="ANE placement (rules: npumoe.backends.apple_ane.rules)")
    for r in reports:
        states = ", ".join(f"{n.removesuffix('_cache')}{list(s)}" for n, s in r.states.items()) or "-"
        stored = ", ".join(COMPRESSION_NAMES.get(c, c) for c in r.compression) or "fp16"
        rules_broken = sorted({v.rule for v in r.violations})
        table.add_row(r.package.removesuffix(".mlpackage"), r.function, str(r.ops), f"{r.weight_bytes / 1e6:.2f} MB",
                      stored, states, r.placement + (f" ({', '.join(rules_broken)})" if rules_broken else ""))
    return table


@click.command("lint")
@click.argument("packages", nargs=-1, required=True, type=click.Path())
@click.option("--platform", type=click.Choice(sorted(rules.MAX_PACKAGE_BYTES)), default=rules.DEFAULT_PLATFORM,
              show_default=True, help="Package size limit to check against.")
def lint_command(packages, platform):
    """Check Core ML packages against the ANE rule table; exit 2 on any violation.

    \b
    Examples:
      npumoe lint build/ane            (every package of an npumoe build --target ane output)
      npumoe lint demo-ane/model.pte   (the Core ML models of an npumoe export --target ane program)
    """
    from rich.console import Console

    with tempfile.TemporaryDirectory() as scratch:
        paths = expand(packages, Path(scratch))
        reports = [r for p in paths for r in lint_package(p, platform)]
    console = Console()
    console.print(placement_table(reports))
    found = violations(reports)
    for v in found:
        console.print(f"[red]✗[/red] {v}", highlight=False)
    for rule in sorted({v.rule for v in found}):
        console.print(f"  rule {rule}: {rules.RULES[rule].requirement} ({rules.RULES[rule].source})", highlight=False)
    if found:
        raise ArtifactError(f"{len(found)} ANE rule violation(s); first: {found[0]}.")
    click.echo(f"{len(reports)} functions in {len(paths)} packages: all pass the ANE rules.")
