"""Read a saved ``.mlpackage`` on any OS: its spec, functions, typed values and weight blobs.

The spec is the ``Model.mlmodel`` protobuf (parsed with coremltools' generated classes,
no Core ML runtime). Weights live in ``weights/weight.bin`` in MIL blob storage v2, read
here: a 64-byte header (count, version), then per blob a 64-byte record (sentinel
0xDEADBEEF, data type, size in bytes, data offset, padding bits) and the data, 64-byte
aligned. Sub-byte types are packed least significant bits first.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from npumoe.core.base.errors import ArtifactError, BackendUnavailableError

SPEC_PATH = Path("Data/com.apple.CoreML/model.mlmodel")
BLOB_SENTINEL = 0xDEADBEEF
BLOB_TYPES = {1: "FLOAT16", 2: "FLOAT32", 3: "UINT8", 4: "INT8", 6: "INT16", 7: "UINT16", 8: "INT4", 9: "UINT1",
              10: "UINT2", 11: "UINT4", 12: "UINT3", 13: "UINT6", 14: "INT32", 15: "UINT32"}
NUMPY = {"FLOAT16": np.float16, "FLOAT32": np.float32, "FLOAT64": np.float64, "BOOL": np.bool_, "INT8": np.int8,
         "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "UINT8": np.uint8, "UINT16": np.uint16,
         "UINT32": np.uint32, "UINT64": np.uint64}
SUB_BYTE = {"INT4": 4, "UINT4": 4, "UINT2": 2, "UINT1": 1, "UINT3": 3, "UINT6": 6}  # bits per element


def proto():
    """coremltools' protobuf classes (Model_pb2, MIL_pb2)."""
    try:
        from coremltools.proto import MIL_pb2, Model_pb2
    except ImportError as err:
        raise BackendUnavailableError(
            f"reading Core ML packages needs coremltools ({err}); install it with pip install 'npumoe[ane]'."
        ) from err
    return Model_pb2, MIL_pb2


@dataclass(frozen=True)
class TensorSpec:
    dtype: str  # MIL DataType name, e.g. "FLOAT16"
    shape: tuple[int | None, ...]  # None marks a dimension that is not fixed
    state: bool = False

    @property
    def static(self) -> bool:
        return all(d is not None for d in self.shape)


def tensor_spec(value_type) -> TensorSpec | None:
    """The tensor (or state-wrapped tensor) a MIL ValueType describes; None for lists, tuples…"""
    _, mil = proto()
    kind = value_type.WhichOneof("type")
    if kind == "stateType":
        inner = tensor_spec(value_type.stateType.wrappedType)
        return TensorSpec(inner.dtype, inner.shape, state=True)
    if kind != "tensorType":
        return None
    t = value_type.tensorType
    shape = tuple(d.constant.size if d.WhichOneof("dimension") == "constant" else None for d in t.dimensions)
    return TensorSpec(mil.DataType.Name(t.dataType), shape)


def unpack_bits(raw: np.ndarray, bits: int, count: int, signed: bool) -> np.ndarray:
    planes = np.unpackbits(raw, bitorder="little")[: count * bits].reshape(count, bits).astype(np.int16)
    values = (planes << np.arange(bits, dtype=np.int16)).sum(axis=1)
    if signed:
        values = np.where(values >= 1 << (bits - 1), values - (1 << bits), values)
    return values.astype(np.int8 if signed else np.uint8)


def blob_values(op):
    """The MIL Values of an operation (and of the blocks nested in it) stored in a weight blob:
    a const's value and any value bound directly to an input."""
    values = [op.attributes["val"]] if op.type == "const" else [
        b.value for arg in op.inputs.values() for b in arg.arguments if b.WhichOneof("binding") == "value"]
    yield from (v for v in values if v.WhichOneof("value") == "blobFileValue")
    for block in op.blocks:
        for inner in block.operations:
            yield from blob_values(inner)


class BlobFile:
    """One ``weight.bin``: typed arrays by the offsets the spec's ``blobFileValue`` records name."""

    def __init__(self, path: Path):
        self.path = path
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        if self.data.size < 64 or struct.unpack_from("<II", self.data, 0)[1] != 2:
            raise ArtifactError(f"{path} is not MIL blob storage v2; the package is damaged, rebuild it.")

    def read(self, offset: int, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
        sentinel, code, size, data_offset = struct.unpack_from("<IIQQ", self.data, offset)
        if sentinel != BLOB_SENTINEL or BLOB_TYPES.get(code) != dtype:
            raise ArtifactError(
                f"{self.path} has no {dtype} blob at offset {offset} (found type {code}); the package is damaged."
            )
        raw = self.data[data_offset:data_offset + size]
        count = int(np.prod(shape, dtype=np.int64))
        if dtype in SUB_BYTE:
            return unpack_bits(np.asarray(raw), SUB_BYTE[dtype], count, dtype.startswith("INT")).reshape(shape)
        return np.frombuffer(raw, dtype=NUMPY[dtype], count=count).reshape(shape)


class Package:
    """A saved ML program package: ``functions``, their descriptions, ops and constant values."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        spec_file = self.path / SPEC_PATH
        if not spec_file.is_file():
            raise ArtifactError(f"{self.path} is not an .mlpackage (no {SPEC_PATH}); give one npumoe build wrote.")
        model_pb2, _ = proto()
        self.spec = model_pb2.Model()
        try:
            self.spec.ParseFromString(spec_file.read_bytes())
        except Exception as err:  # protobuf raises its own DecodeError
            raise ArtifactError(f"{spec_file} is not a Core ML model spec ({err}); the package is damaged.") from err
        kind = self.spec.WhichOneof("Type")
        if kind != "mlProgram":
            raise ArtifactError(f"{self.path} holds a {kind} model, not an ML program; npumoe reads ML programs only.")
        self._blobs: dict[str, BlobFile] = {}

    @cached_property
    def functions(self) -> dict:
        """Name → MIL function, in the order the package describes them."""
        program = self.spec.mlProgram.functions
        order = [d.name for d in self.spec.description.functions] or sorted(program)
        return {name: program[name] for name in order}

    def function(self, name: str):
        if name not in self.functions:
            raise ArtifactError(
                f"{self.path.name} has no function {name!r}; it has {', '.join(sorted(self.functions))}."
            )
        return self.functions[name]

    def operations(self, name: str) -> list:
        f = self.function(name)
        return list(f.block_specializations[f.opset].operations)

    def block_outputs(self, name: str) -> list[str]:
        f = self.function(name)
        return list(f.block_specializations[f.opset].outputs)

    def description(self, name: str):
        """The function's FunctionDescription: ``input``, ``output`` and ``state`` features."""
        self.function(name)
        for desc in self.spec.description.functions:
            if desc.name == name:
                return desc
        return self.spec.description  # a single-function package describes "main" at the top level

    def inputs(self, name: str) -> dict[str, TensorSpec]:
        return {i.name: tensor_spec(i.type) for i in self.function(name).inputs}

    # -- values --------------------------------------------------------------------------------------
    def value(self, v) -> np.ndarray | str:
        """A MIL Value (immediate or in the weight blob) as numpy, with its declared dtype and shape."""
        spec = tensor_spec(v.type)
        kind = v.WhichOneof("value")
        if kind == "blobFileValue":
            return self.blob_file(v.blobFileValue.fileName).read(v.blobFileValue.offset, spec.dtype, spec.shape)
        tensor = v.immediateValue.tensor
        field = tensor.WhichOneof("value")
        if spec.dtype == "STRING":
            values = list(tensor.strings.values)
            return values[0] if not spec.shape else values
        if field == "bytes":
            raw = np.frombuffer(tensor.bytes.values, dtype=np.uint8)
            count = int(np.prod(spec.shape, dtype=np.int64))
            if spec.dtype in SUB_BYTE:
                return unpack_bits(raw, SUB_BYTE[spec.dtype], count, spec.dtype.startswith("INT")).reshape(spec.shape)
            return raw.view(NUMPY[spec.dtype])[:count].reshape(spec.shape)
        values = getattr(tensor, field).values if field else []
        return np.asarray(values, dtype=NUMPY[spec.dtype]).reshape(spec.shape)

    def blob_file(self, file_name: str) -> BlobFile:
        if file_name not in self._blobs:
            rel = file_name.removeprefix("@model_path/")
            self._blobs[file_name] = BlobFile(self.path / SPEC_PATH.parent / rel)
        return self._blobs[file_name]

    def const_bytes(self, name: str) -> int:
        """Bytes of the weights one function reads, as stored (compressed, if it is)."""
        total = 0
        for op in self.operations(name):
            for v in blob_values(op):
                blob = self.blob_file(v.blobFileValue.fileName)
                total += struct.unpack_from("<Q", blob.data, v.blobFileValue.offset + 8)[0]
        return total

    @property
    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())
