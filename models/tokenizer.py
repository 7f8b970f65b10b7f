"""Text ↔ token ids. Byte-level for the demo model; a checkpoint's tokenizer.json otherwise.

A prompt that is not valid UTF-8 (a shell in another locale hands such bytes to Python as lone surrogates) is
refused with the position and the fix rather than run with U+FFFD in place of its bytes: that would continue
another prompt than the one given, with no sign of it. (Calibration text files are read with errors="replace":
there a few replaced bytes do not change the routing statistics.)
"""

from __future__ import annotations

from pathlib import Path

from npumoe.core.base.errors import InputError
from npumoe.core.base.outputs import json_object

MARKER = "npumoe_tokenizer.json"  # {"kind": "bytes"}: token id = byte value


def utf8(text: str) -> bytes:
    """The prompt's UTF-8 bytes, or an InputError naming the first character that has none."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        what = f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"the lone surrogate U+{code:04X}"
        raise InputError(f"the prompt is not valid UTF-8: character {err.start} is {what}; give it as UTF-8 text (or "
                         "pass token ids with --ids).") from None


class ByteTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(utf8(text))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A fast tokenizer from tokenizer.json, through the `tokenizers` package."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        utf8(text)
        return self._tok.encode(text).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])


class MissingTokenizer:
    """Stands in for a tokenizer npumoe cannot use: the model still loads (and runs on --ids), and text is
    refused on first use with the reason."""

    def __init__(self, model_dir: Path, reason: str | None = None):
        self.reason = reason or f"{model_dir} has no tokenizer.json (or the `tokenizers` package is missing)"

    def encode(self, text: str) -> list[int]:
        raise InputError(f"{self.reason}; pass token ids with --ids instead of a text prompt.")

    decode = encode


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer: npumoe's byte marker, else tokenizer.json, else a stand-in that says why not."""
    marker, file = model_dir / MARKER, model_dir / "tokenizer.json"
    if marker.exists():
        return ByteTokenizer() if json_object(marker).get("kind") == "bytes" else MissingTokenizer(
            model_dir, f"{marker} is not npumoe's tokenizer marker ({{\"kind\": \"bytes\"}})")
    if file.is_dir():
        return MissingTokenizer(model_dir, f"{file} is a directory, not a tokenizer file")
    if file.exists():
        try:
            return HFTokenizer(file)
        except ImportError:
            pass
        except Exception as err:  # noqa: BLE001 - the tokenizers package raises a bare Exception for any bad file
            return MissingTokenizer(model_dir, f"{file} is not a tokenizer the `tokenizers` package can read ({err})")
    return MissingTokenizer(model_dir)

