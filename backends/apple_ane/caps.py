"""What the planner may assume about the Apple Neural Engine, derived from the lint's rule table.

No coremltools import needed: the planner reads this without the toolchain installed.
"""

from npumoe.backends.apple_ane import rules
from npumoe.backends.base import Capabilities

ANE_CAPS = Capabilities(
    name="ane",
    ops=rules.ir_ops_on_ane(),
    dtypes=(rules.COMPUTE_DTYPE,),
    static_shapes=True,
    alignment=rules.CHANNEL_ALIGNMENT,
    pow2_state_dims=True,
    max_states=rules.MAX_STATES,  # one concatenated K and one V state per package
    max_graph_bytes=rules.max_graph_bytes(),  # graph budget, capped by the iOS package limit
    dispatch_seconds=2e-4,  # one Core ML prediction on an ANE-resident function, order of magnitude
    flops_per_second=3e12,  # fp16, sustained for FFN-sized 1×1 convs (M2-class estimate; peak 15.8 T)
    notes=(
        f"packages ≤ {rules.MAX_PACKAGE_BYTES['ios'] / 1e9:g} GB on iOS, "
        f"≤ {rules.MAX_PACKAGE_BYTES['macos'] / 1e9:g} GB on macOS",
        "FP16 compute only",
        "rule table: npumoe.backends.apple_ane.rules (checked by npumoe lint)",
    ),
)
