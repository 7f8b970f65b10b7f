"""Single-function ``.mlpackage`` s merged into one multifunction package, one weight blob at a time.

coremltools' ``save_multifunction`` loads every function's weights into a MIL program to find the
shared ones, so a layer of 64 experts at prefill and decode capacity held ~7 GB to write an 0.8 GB
package. The merge needs no program: each function's spec is copied as it is, its blob references
re-pointed into one new ``weight.bin`` (MIL blob storage v2, the layout :mod:`.mlpackage` reads), and
a blob whose type and bytes were already written is referenced again rather than stored twice. The
result has the spec ``save_multifunction`` writes (tested); memory is one blob.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import uuid
from pathlib import Path

from npumoe.backends.apple_ane.mlpackage import SPEC_PATH, BlobFile, Package, blob_values, proto

WEIGHTS_REL = "weights/weight.bin"
WEIGHTS_REF = f"@model_path/{WEIGHTS_REL}"
ALIGN = 64  # blob storage v2 aligns every record and its data to 64 bytes
HEADER = struct.Struct("<II56x")  # blob count, storage version 2
RECORD = struct.Struct("<IIQQQ32x")  # sentinel, data type, size in bytes, data offset, padding bits
IOS18_SPEC_VERSION = 9  # the first Core ML spec version with multifunction models


class BlobWriter:
    """A new ``weight.bin``: blobs appended from other blob files, identical ones stored once."""

    def __init__(self, path: Path):
        self.file = path.open("wb")
        self.file.write(HEADER.pack(0, 2))
        self.count = 0
        self.offsets: dict[tuple, int] = {}  # (data type, padding, sha256 of data) → record offset

    def copy(self, source: BlobFile, offset: int) -> int:
        """The offset in this file of the record that ``source`` holds at ``offset``."""
        sentinel, dtype, size, data_offset, padding = RECORD.unpack_from(source.data, offset)
        data = source.data[data_offset:data_offset + size]
        key = (dtype, padding, hashlib.sha256(data).digest())
        if key not in self.offsets:
            self.file.write(b"\0" * (-self.file.tell() % ALIGN))  # records start aligned; the file ends unpadded
            record = self.file.tell()
            self.file.write(RECORD.pack(sentinel, dtype, size, record + ALIGN, padding))
            self.file.write(data)
            self.offsets[key] = record
            self.count += 1
        return self.offsets[key]

    def close(self) -> None:
        self.file.seek(0)
        self.file.write(HEADER.pack(self.count, 2))
        self.file.close()


class MultifunctionWriter:
    """``dest`` (an ``.mlpackage`` not yet existing) written function by function: each single-function package's
    blobs are appended as it is added (so the caller may delete it at once), its spec on :meth:`finish`. The first
    function added is the default."""

    def __init__(self, dest: Path):
        model_pb2, _ = proto()
        self.dest = dest
        self.data_dir = dest / SPEC_PATH.parent
        (self.data_dir / WEIGHTS_REL).parent.mkdir(parents=True)
        self.merged = model_pb2.Model()
        self.blobs = BlobWriter(self.data_dir / WEIGHTS_REL)

    def add(self, name: str, path: Path) -> None:
        source = Package(path)
        function = source.function("main")
        for op in source.operations("main"):
            for value in blob_values(op):
                ref = value.blobFileValue
                ref.offset = self.blobs.copy(source.blob_file(ref.fileName), ref.offset)
                ref.fileName = WEIGHTS_REF
        merged = self.merged
        merged.mlProgram.functions[name].CopyFrom(function)
        desc = source.spec.description
        merged.description.functions.add(name=name, input=desc.input, output=desc.output, state=desc.state)
        merged.specificationVersion = max(merged.specificationVersion, source.spec.specificationVersion,
                                          IOS18_SPEC_VERSION)
        merged.mlProgram.version = source.spec.mlProgram.version
        if not merged.description.defaultFunctionName:
            merged.description.defaultFunctionName = name

    def finish(self) -> None:
        self.blobs.close()
        (self.data_dir / SPEC_PATH.name).write_bytes(self.merged.SerializeToString())
        _write_manifest(self.dest)

    def abort(self) -> None:
        """Remove the partial package."""
        self.blobs.file.close()
        shutil.rmtree(self.dest, ignore_errors=True)


def merge(functions: dict[str, Path], dest: Path) -> None:
    """Write ``dest`` holding each single-function package of ``functions`` (target name → package) as that
    function; the first is the default."""
    writer = MultifunctionWriter(dest)
    try:
        for name, path in functions.items():
            writer.add(name, path)
    except BaseException:
        writer.abort()
        raise
    writer.finish()


def _write_manifest(package: Path) -> None:
    """The package's ``Manifest.json``: the model spec (its root) and the weights directory, under fixed
    identifiers so that the same functions always give the same bytes."""
    spec_id, weights_id = (str(uuid.uuid5(uuid.NAMESPACE_URL, f"npumoe:{item}")) for item in ("spec", "weights"))
    items = {
        spec_id: {"author": "com.apple.CoreML", "description": "CoreML Model Specification",
                  "name": SPEC_PATH.name, "path": f"com.apple.CoreML/{SPEC_PATH.name}"},
        weights_id: {"author": "com.apple.CoreML", "description": "CoreML Model Weights",
                     "name": "weights", "path": "com.apple.CoreML/weights"},
    }
    manifest = {"fileFormatVersion": "1.0.0", "itemInfoEntries": items, "rootModelIdentifier": spec_id}
    (package / "Manifest.json").write_text(json.dumps(manifest, indent=4))
