"""Text ↔ token ids. Byte-level for the demo model; a checkpoint's tokenizer.json otherwise."""

from __future__ import annotations

import json
from pathlib import Path

from npumoe.errors import InputError

MARKER = "npumoe_tokenizer.json"  # {"kind": "bytes"}: token id = byte value


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A fast tokenizer from tokenizer.json, through the `tokenizers` package."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


class MissingTokenizer:
    def __init__(self, model_dir: Path):
        self.model_dir = model_dir

    def encode(self, text: str) -> list[int]:
        raise InputError(
            f"{self.model_dir} has no tokenizer.json (or the `tokenizers` package is missing); "
            "pass token ids with --ids instead of a text prompt."
        )

    decode = encode


def load_tokenizer(model_dir: Path):
    marker = model_dir / MARKER
    if marker.exists() and json.loads(marker.read_text()).get("kind") == "bytes":
        return ByteTokenizer()
    if (model_dir / "tokenizer.json").exists():
        try:
            return HFTokenizer(model_dir / "tokenizer.json")
        except ImportError:
            pass
    return MissingTokenizer(model_dir)
