"""Checkpoint directories and the quantised formats in them: read (npumoe's own, GPTQ, MXFP4, FP8) and written
(npumoe quantize)."""
