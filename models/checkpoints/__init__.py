"""Checkpoint directories and the quantised formats in them: read (npumoe's own, GPTQ, MXFP4, FP8) and written
(npumoe quantize).

The choices `npumoe quantize` offers are defined here, beside nothing heavy, so its --help needs no torch.
"""

LINEARS = {"experts": "routed experts", "all": "every linear but the routers"}  # what --linears packs
HEAD_BITS = 6  # the LM head's least bits with --linears all: llama.cpp's Q4_0 and Q2_K files keep theirs at Q6_K
