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
    checkpoint  model directories with packed routed experts (``npumoe.load`` reads them)
    quantize    ``npumoe quantize``: a Hugging Face checkpoint → such a directory
    bench       ``npumoe bench lut``

Nothing heavy is imported here: ``import npumoe.luts.spec`` stays numpy-only.
"""
