"""T-MAN's low-bit weight format on CPUs, and its mapping to the NPU backends.

One packed weight (bit-serial planes, float16 scale and integer zero point per group)
serves decode as a LUT-GEMV, prefill as a fused LUT-dequant GEMM, and the Core ML and QNN
backends through :mod:`.mappings`. Modules, each with one job:

    spec        the normative numpy definition: format, quantisation, tables, accumulation
    gptq        import of GPTQ qweight / qzeros / scales
    layout      the kernels' 64-byte tile arrangement of the same bits
    build       compile the C kernels on first use, cached per ISA
    kernels     the compiled kernels, chosen by CPU detection (AVX-512, AVX2, NEON, portable)
    emulated    another architecture's kernels under qemu-user (tests NEON on x86)
    torch_op    ``npumoe::lut_linear`` and the ``LutLinear`` module
    mappings    the same weight as Core ML / ONNX-QDQ quantisation parameters
    mxfp4       gpt-oss's E2M1 codes as luts codes
    decode      the fused decode calls (a MoE block, an attention block, a whole step)
    estimate    llvm-mca estimates of the NEON kernels' speed

Checkpoints that hold these codes are read and written in :mod:`npumoe.models.checkpoints`; the
benchmarks live in :mod:`npumoe.bench`.

Nothing heavy is imported here: ``import npumoe.luts.spec`` stays numpy-only, and the bit widths the CLI offers
need not even numpy.
"""

BITS = (1, 2, 3, 4, 5, 6, 8)  # bits per weight the format takes
