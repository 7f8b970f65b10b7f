"""``--via executorch``: the same ANE-layout modules lowered by ExecuTorch's Core ML partitioner to ``.pte``.

One ``.pte`` per package, one method per function. Lowering runs anywhere; running a
``.pte`` needs ExecuTorch's Core ML delegate, which exists only on macOS. Two differences
from the ``coreml`` path, both ExecuTorch's: each method carries its own copy of the
delegate (weights are not shared across methods) and its own Core ML states (prefill and
decode methods do not share one KV cache).

ExecuTorch converts in fp32 and lets Core ML cast to fp16 (its state reads are fp32), so
modules are exported in fp32 here. coremltools' two state-canonicalisation passes fail on
the ``slice_scatter`` ExecuTorch emits for the KV write, so they are left out; our own
passes run as in the ``coreml`` path.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from npumoe.backends.apple_ane.compress import INT4_BLOCK
from npumoe.backends.apple_ane.layout import AneGraphModule
from npumoe.core.base.errors import ArtifactError, BackendUnavailableError

REFERENCE_MARK = b"CMJR"  # ExecuTorch's Core ML backend: this delegate's model is in the program's named data
SKIPPED_PASSES = ("common::canonicalize_inplace_pattern", "common::prefer_state_in_downstream")


def _compile_specs(precision: str):
    import coremltools as ct
    from executorch.backends.apple.coreml.compiler import CoreMLBackend

    from npumoe.backends.apple_ane import passes

    quantizer = None
    if precision == "int4":
        quantizer = {"mode": "linear_symmetric", "dtype": "int4", "granularity": "per_block", "block_size": INT4_BLOCK}
    return CoreMLBackend.generate_compile_specs(
        compute_unit=ct.ComputeUnit.CPU_AND_NE,
        minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.precision.FLOAT16,
        op_linear_quantizer_config=quantizer,
        pass_names=[p for p in passes.pipeline().passes if p not in SKIPPED_PASSES],
    )


def save_pte(modules: dict[str, AneGraphModule], path: Path, precision: str) -> None:
    try:
        from executorch.backends.apple.coreml.partition import CoreMLPartitioner
        from executorch.exir import to_edge_transform_and_lower
    except ImportError as err:
        raise BackendUnavailableError(
            f"--via executorch needs executorch ({err}); install it with pip install executorch==1.5.1."
        ) from err
    programs = {}
    for name, module in modules.items():
        module = module.float().eval()
        example = tuple(torch.zeros(s, dtype=torch.int32 if module.input_is_int(n) else torch.float32)
                        for n, s in module.input_shapes().items())
        programs[name] = torch.export.export(module, example, strict=False)
    partitioner = CoreMLPartitioner(compile_specs=_compile_specs(precision))
    lowered = to_edge_transform_and_lower(programs, partitioner=[partitioner])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(lowered.to_executorch().buffer)


class PteRuntime:
    """A ``.pte`` on ExecuTorch's runtime (macOS only: the Core ML delegate needs Core ML)."""

    def __init__(self, path: Path):
        if sys.platform != "darwin":
            raise BackendUnavailableError(
                f"{path.name} is an ExecuTorch program for the Core ML delegate, which runs only on macOS 15+; "
                "on this machine build with --via coreml and the packages run on npumoe's MIL interpreter."
            )
        from executorch.runtime import Runtime

        self.program = Runtime.get().load_program(str(path))
        self._methods: dict[str, object] = {}

    def run(self, function: str, feed: dict[str, np.ndarray]) -> tuple[np.ndarray, ...]:
        """Outputs in the graph's output order (a .pte method has no output names)."""
        if function not in self._methods:
            self._methods[function] = self.program.load_method(function)
        inputs = [torch.from_numpy(v.astype(np.float32) if v.dtype == np.float16 else v) for v in feed.values()]
        return tuple(o.numpy() for o in self._methods[function].execute(inputs))


def core_ml_packages(program: bytes, out_dir: Path) -> list[Path]:
    """The Core ML models an ExecuTorch program delegates to, unpacked as ``out_dir/partition_N.mlpackage``, in the
    order of their first use. ExecuTorch's Core ML backend stores a partition as a flattened directory (the
    ``.mlpackage`` and its metadata); where several methods share a partition (a multifunction model, one function a
    method: its weights stored once), the delegate's data is a ``CMJR``-marked reference into the program's named
    data, unpacked once."""
    from executorch.backends.apple.coreml import executorchcoreml
    from executorch.exir._serialize._program import deserialize_pte_binary

    pte = deserialize_pte_binary(program)
    named = pte.named_data
    stored = {key: named.buffers[entry.buffer_index] for key, entry in named.pte_data.items()} if named else {}
    payloads = {}  # key (or position) → bytes, first use first
    for plan in pte.program.execution_plan:
        for delegate in plan.delegates:
            if delegate.id != "CoreMLBackend":
                continue
            data = pte.program.backend_delegate_data[delegate.processed.index].data
            if data.startswith(REFERENCE_MARK):
                key = json.loads(data[len(REFERENCE_MARK):])["key"]
                payloads.setdefault(key, stored[key])
            else:
                payloads[len(payloads)] = data
    packages = []
    for n, payload in enumerate(payloads.values()):
        with tempfile.TemporaryDirectory(dir=out_dir) as unpacked:
            if not executorchcoreml.unflatten_directory_contents(bytes(payload), unpacked):
                raise ArtifactError(f"Core ML partition {n} of the program does not unpack; export it again.")
            (found,) = Path(unpacked).rglob("*.mlpackage")
            packages.append(found.rename(out_dir / f"partition_{n}.mlpackage"))
    return packages
