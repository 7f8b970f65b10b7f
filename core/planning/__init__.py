"""How experts are used (the routing profile), what to build for them (the planner), and what it costs (the cost
model).

The planner's choices are defined here, beside nothing heavy, so `npumoe plan --help` needs no torch.
"""

METHODS = ("optimal", "paper", "uniform")
OVERFLOW_POLICIES = ("spill", "drop", "reroute")
RESIDENCY = ("auto", "npu", "cpu")
GRAPHS_PER_LAYER = 3  # compiled NPU expert graphs per layer and sequence length, shared by its groups
