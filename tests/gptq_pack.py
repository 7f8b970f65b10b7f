"""GPTQ's packing, written out value by value from its definition (the truth the importer is tested against)."""

import numpy as np


def pack_words(values: np.ndarray, bits: int) -> np.ndarray:
    """Rows of b-bit values → int32 words: value j at bits b·j.. of the row's stream (GPTQ's packing)."""
    rows = []
    for row in values:
        stream = sum(int(v) << (bits * j) for j, v in enumerate(row))
        rows.append([(stream >> (32 * w)) & 0xFFFFFFFF for w in range(len(row) * bits // 32)])
    return np.array(rows, dtype=np.uint32).view(np.int32)
