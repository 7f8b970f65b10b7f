"""What the planner may assume about the Apple Neural Engine. No coremltools import needed."""

from npumoe.backends.base import Capabilities
from npumoe.core.ir import OPS

ANE_CAPS = Capabilities(
    name="ane",
    ops=frozenset(OPS - {"lut_linear"}),  # low-bit weights reach Core ML as constexpr decompression instead
    dtypes=("float16",),
    static_shapes=True,
    alignment=16,  # ANE tiles channels and sequence in multiples of 16 (NPUMoE §4, ANE MoE chapter)
    pow2_state_dims=True,
    max_states=2,  # one concatenated K and one V state per package
    max_graph_bytes=int(1.2e9),  # NPUMoE §4.2: graphs above ~1.2 GB fell back to CPU on M2 Ultra
    dispatch_seconds=2e-4,  # one Core ML prediction on an ANE-resident function, order of magnitude
    flops_per_second=3e12,  # fp16, sustained for FFN-sized 1×1 convs (M2-class estimate; peak 15.8 T)
    notes=("packages ≤ 1 GB on iOS, ≤ 2 GB on macOS", "FP16 compute only"),
)
