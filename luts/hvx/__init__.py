"""T-MAN's LUT-GEMV as a Hexagon HVX kernel, verified bit-exact under qemu-hexagon.

The C sources (``*.c``, ``*.h``) build with Debian's clang-16 into one freestanding
harness that qemu-hexagon-static runs; the Python modules, each with one job:

    layout  the HVX tile and table arrangement of the canonical luts format (repack)
    build   compile the harness, cached by a hash of the sources
    driver  run it under qemu: VLUT16 probes and whole GEMVs with every intermediate
    cost    instruction counts from the disassembly, and a cost model from T-MAN's figures

``npumoe bench hvx`` (:mod:`npumoe.bench.hvx`) runs them.

How the kernel becomes a QNN HTP op package is in README.md.
"""
