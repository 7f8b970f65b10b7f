"""Safetensors files mapped, not read: headers parsed by hand, tensors as views of the mapping.

A 7 B checkpoint does not fit in memory as fp32 and need not be read at all to be inspected
or planned, so nothing here reads tensor data until a tensor is asked for, and then only
maps it: ``tensor(key)`` is a zero-copy torch view of a private (copy-on-write) mapping of
the file, in the stored dtype. Its pages are the file's, shared with the page cache, and
count as file-backed memory the kernel can drop, not as the process's private memory.

Sharded checkpoints are found through ``model.safetensors.index.json``, which also names
any shard that is missing. Every header is checked against its file before it is used, as the
safetensors library checks it (whole-number shapes and offsets, each tensor's bytes within the data
section and exactly its dtype × shape, no two tensors sharing bytes), so a truncated or malformed file
is an error naming it, never a crash or a tensor read from another's bytes. A tensor stored in two
files is an error naming both: which copy is meant, nothing says.

The format allows no gaps between tensors, so a writer that aligns a tensor (the LUT kernels' tiles start
on a cache line) fills the gap with a padding tensor named ``__padding__.<n>``; readers here do not list those.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from npumoe.core.base.errors import WeightError

INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 << 20  # the safetensors library's own limit
PADDING = "__padding__."  # names of the filler tensors an aligned write leaves between tensors

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
}  # fmt: skip
FLOAT_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.bfloat16})


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are: its file, dtype, shape and byte range in that file."""

    file: Path
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute file offset
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class SafetensorsFile:
    """One file's header, parsed and checked; its data mapped on first use."""

    def __init__(self, path: Path):
        self.path = path
        self._map: mmap.mmap | None = None
        self.entries, self.metadata = _parse_header(path)

    def tensor(self, key: str) -> torch.Tensor:
        """A view of the stored bytes as a tensor (no copy; writes stay private to this process)."""
        entry = self.entries[key]
        if entry.nbytes == 0:
            return torch.empty(entry.shape, dtype=entry.dtype)
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        flat = torch.frombuffer(self._map, dtype=entry.dtype, count=entry.numel, offset=entry.start)
        return flat.view(entry.shape)


def _parse_header(path: Path) -> tuple[dict[str, StoredTensor], dict[str, str]]:
    def bad(why: str) -> WeightError:
        return WeightError(f"{path.name} is not a readable safetensors file ({why}); re-save or re-download it.")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad("shorter than its 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER, size - 8):
                raise bad(f"its header claims {length} bytes, more than the file holds")
            try:
                header = json.loads(f.read(length))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise bad(f"its header is not JSON: {err}") from err
    except OSError as err:
        if path.is_symlink() and not path.exists():
            raise WeightError(f"{path} is a symbolic link to {path.readlink()}, which does not exist; restore that "
                              "file or the link.") from err
        raise WeightError(f"{path} cannot be read ({err.strerror}); check the file and its permissions.") from err
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad("its __metadata__ is not an object of strings")
    base, data_size = 8 + length, size - 8 - length
    entries = {}
    for key, info in header.items():
        try:
            dtype = DTYPES[info["dtype"]]
            shape, (begin, end) = tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor {key!r} has a malformed entry {info!r:.80}") from None
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (*shape, begin, end)):
            raise bad(f"tensor {key!r} has a shape or offsets that are not whole numbers ≥ 0: {info!r:.80}")
        nbytes = math.prod(shape) * dtype.itemsize
        if not begin <= end <= data_size or end - begin != nbytes:
            raise bad(f"tensor {key!r} ({info['dtype']} {list(shape)}) does not fit its byte range {[begin, end]} "
                      f"of {data_size} data bytes; the file is truncated or damaged")
        entries[key] = StoredTensor(path, key, dtype, shape, base + begin, nbytes)
    _check_no_overlap(entries, bad)
    return {key: e for key, e in entries.items() if not key.startswith(PADDING)}, metadata


def _check_no_overlap(entries: dict[str, StoredTensor], bad) -> None:
    """No two tensors share a byte: one would be read from the other's data."""
    spans = sorted((e.start, e.start + e.nbytes, key) for key, e in entries.items() if e.nbytes)
    for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
        if start < end:
            raise bad(f"tensors {first!r} and {second!r} overlap in its data section")


class Checkpoint:
    """Every tensor of a checkpoint directory by stored name, from one file or an index of shards."""

    def __init__(self, files: list[Path]):
        self.files = {p.name: SafetensorsFile(p) for p in files}
        self.entries: dict[str, StoredTensor] = {}
        for f in self.files.values():
            for key, entry in f.entries.items():
                if key in self.entries:
                    raise WeightError(f"tensor {key!r} is stored in both {self.entries[key].file} and {f.path}; "
                                      "which copy is meant is unclear, so remove the stale file (or the tensor from "
                                      "one of them).")
                self.entries[key] = entry

    @classmethod
    def open(cls, directory: Path, files: list[Path]) -> Checkpoint:
        """``files`` are the directory's ``*.safetensors``; an index, if present, decides which are read."""
        index = directory / INDEX
        if not index.is_file():
            return cls(files)
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as err:
            raise WeightError(f"{index} is not a readable safetensors index ({err!r}); restore it or delete it so "
                              "the shards are read directly.") from err
        missing = [s for s in shards if not (directory / s).is_file()]
        if missing:
            raise WeightError(f"shard {missing[0]} named in {INDEX} is missing from {directory}; copy or download "
                              "it again.")
        ckpt = cls([directory / s for s in shards])
        absent = [k for k, s in weight_map.items() if ckpt.entries.get(k, None) is None
                  or ckpt.entries[k].file.name != s]
        if absent:
            raise WeightError(f"{INDEX} places tensor {absent[0]!r} in {weight_map[absent[0]]}, which does not hold "
                              "it; the index and the shards disagree.")
        return ckpt

    def tensor(self, key: str) -> torch.Tensor:
        return self.files[self.entries[key].file.name].tensor(key)

    def metadata(self) -> dict[str, str]:
        merged: dict[str, str] = {}
        for f in self.files.values():
            merged.update(f.metadata)
        return merged

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())


DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsWriter:
    """Writes a safetensors file one tensor at a time, so a large checkpoint is never held whole.

    Data goes straight into a temporary file beside the destination, after room left for the header
    (``tensors`` sizes it: the number of tensors to come); ``finish`` writes the header into that room,
    padded with spaces as the format allows, and renames the file into place, so the data is written
    once and an interrupted write leaves nothing under the final name. A header that outgrows its room
    is written the slow way: header, then the data copied after it. The data section starts on a multiple of
    ``ALIGN`` bytes of the file, so a tensor added with ``align`` up to that lies at such a multiple in a mapping."""

    ALIGN = 64  # safetensors pads the header with spaces; 64 puts the data on a cache line
    HEADER_BYTES_PER_TENSOR = 256  # a name of up to ~150 characters with its dtype, shape and offsets

    def __init__(self, path: Path, tensors: int = 0):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = self.path.with_name(f".{self.path.name}.tmp")
        self._room = -(-(8 + 64 + tensors * self.HEADER_BYTES_PER_TENSOR) // self.ALIGN) * self.ALIGN
        self._data = open(self._tmp, "wb")
        self._data.seek(self._room)
        self._header: dict[str, dict] = {}
        self._offset = 0

    def add(self, name: str, tensor: torch.Tensor, align: int = 1) -> None:
        """Append ``tensor``; with ``align``, its data starts at a multiple of that many bytes (≤ ``ALIGN``)."""
        if gap := -self._offset % align:
            self.add(f"{PADDING}{len(self._header)}", torch.zeros(gap, dtype=torch.uint8))
        tensor = tensor.detach().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            self._data.write(tensor.view(-1).view(torch.uint8).numpy())
        self._header[name] = {"dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                              "data_offsets": [self._offset, self._offset + nbytes]}
        self._offset += nbytes

    def finish(self, metadata: dict[str, str] | None = None) -> Path:
        header = dict(sorted(self._header.items()))
        if metadata:
            header = {"__metadata__": metadata, **header}
        blob = json.dumps(header, separators=(",", ":")).encode()
        try:
            if 8 + len(blob) <= self._room:
                blob += b" " * (self._room - 8 - len(blob))
                self._data.seek(0)
                self._data.write(struct.pack("<Q", len(blob)) + blob)
                self._data.close()
            else:
                self._data.close()
                self._rewrite_with(blob + b" " * (-(8 + len(blob)) % self.ALIGN))
            self._tmp.replace(self.path)
        finally:
            self._data.close()
            self._tmp.unlink(missing_ok=True)
        return self.path

    def _rewrite_with(self, blob: bytes) -> None:
        """The header, then the data copied from after the room it did not fit in."""
        moved = self._tmp.with_name(self._tmp.name + ".data")
        self._tmp.replace(moved)
        try:
            with open(self._tmp, "wb") as out, open(moved, "rb") as data:
                out.write(struct.pack("<Q", len(blob)) + blob)
                data.seek(self._room)
                while block := data.read(64 << 20):
                    out.write(block)
        finally:
            moved.unlink(missing_ok=True)

    def abort(self) -> None:
        self._data.close()
        self._tmp.unlink(missing_ok=True)
