"""Core ML conversion: a traced ANE-layout module → an fp16 ML program (iOS18 / macOS15 opset),
and a set of those → one multifunction package whose functions share their weights (:mod:`.multifunction`).

Two traps this avoids: tracing with fp16 states needs a half model (coremltools only
takes fp16 states), and shapes read from tensors while tracing become dynamic ``int`` ops
that coremltools cannot fold under numpy 2 (the layout module keeps them static ints).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import coremltools as ct
import numpy as np
import torch

from npumoe.backends.apple_ane import multifunction, passes
from npumoe.backends.apple_ane.compress import compress
from npumoe.backends.apple_ane.layout import AneGraphModule
from npumoe.core.base.machine import available_memory

DEPLOYMENT_TARGET = ct.target.iOS18  # the same opset as macOS15: states and multifunction need it


def convert_graph(module: AneGraphModule, precision: str, arrays=None) -> ct.models.MLModel:
    """``arrays``: the conv weights' luts arrays when ``precision`` compresses them (:func:`.compress.luts_arrays`)."""
    module = module.half().eval()
    shapes = module.input_shapes()
    example = tuple(torch.zeros(s, dtype=torch.int32 if module.input_is_int(n) else torch.float16)
                    for n, s in shapes.items())
    with torch.no_grad():
        traced = torch.jit.trace(module, example, check_trace=False)
    states = None
    if module.stateful:
        states = [ct.StateType(wrapped_type=ct.TensorType(shape=s, dtype=np.float16), name=n)
                  for n, s in module.kv.shapes.items()]
    with contextlib.redirect_stderr(io.StringIO()):  # its per-pipeline progress bars: noise in npumoe's output
        mlmodel = _convert(traced, module, shapes, states)
        compressed = compress(mlmodel, precision, arrays)
    if compressed is not mlmodel:
        discard(mlmodel)
    return compressed


MEMORY_SCRATCH = Path("/dev/shm")  # a RAM-backed file system, where Linux has one
SPARE_MEMORY = 2 << 30  # left free beside the scratch for the build itself


@contextlib.contextmanager
def converter_scratch(weight_bytes: int) -> Iterator[None]:
    """coremltools writes a converted graph's weights twice before npumoe reads them into the package (its weights
    directory, then its temporary package; a compressed graph's once more, smaller): into RAM (:data:`MEMORY_SCRATCH`)
    when that has room for them and memory to spare, so the disk sees each weight once, in the package; else into the
    usual temporary directory. ``weight_bytes``: the graph's weights at fp16."""
    need = 3 * weight_bytes
    try:
        room = os.access(MEMORY_SCRATCH, os.W_OK) and shutil.disk_usage(MEMORY_SCRATCH).free > need
    except OSError:
        room = False
    if not room or available_memory() < need + SPARE_MEMORY:
        yield
        return
    with tempfile.TemporaryDirectory(dir=MEMORY_SCRATCH, prefix="npumoe-ane-") as scratch:
        before, tempfile.tempdir = tempfile.tempdir, scratch
        try:
            yield
        finally:
            tempfile.tempdir = before


def discard(mlmodel: ct.models.MLModel) -> None:
    """Delete a converted model's temporary package now: coremltools keeps each until the process exits, so a
    build of many graphs in one process would hold every graph's weights on disk until its end."""
    if mlmodel.is_temp_package and mlmodel.package_path:
        shutil.rmtree(mlmodel.package_path, ignore_errors=True)


def _convert(traced, module: AneGraphModule, shapes: dict, states) -> ct.models.MLModel:
    return ct.convert(
        traced,
        inputs=[ct.TensorType(name=n, shape=s, dtype=np.int32 if module.input_is_int(n) else np.float16)
                for n, s in shapes.items()],
        outputs=[ct.TensorType(name=n, dtype=np.float16) for n in module.output_names()],
        states=states,
        convert_to="mlprogram",
        minimum_deployment_target=DEPLOYMENT_TARGET,
        compute_precision=ct.precision.FLOAT16,
        pass_pipeline=passes.pipeline(),
        skip_model_load=True,
    )


class PackageWriter:
    """One ``.mlpackage`` holding several functions, written as they come: each converted function's weights go
    into the package at once (identical weights in two functions stored once) and its converter's temporary
    package is deleted, so the disk holds one function's temporaries at a time and each weight is copied once."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self) -> PackageWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._writer = multifunction.MultifunctionWriter(self.path)
        return self

    def add(self, name: str, mlmodel: ct.models.MLModel) -> None:
        self._writer.add(name, Path(mlmodel.package_path))
        discard(mlmodel)

    def __exit__(self, kind, value, tb) -> None:
        if kind is None:
            self._writer.finish()
        else:
            self._writer.abort()
