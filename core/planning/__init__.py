"""How experts are used (the routing profile), what to build for them (the planner), and what it costs (the cost
model).

The planner's choices are defined here, beside nothing heavy, so `npumoe plan --help` needs no torch.
"""

METHODS = ("optimal", "paper", "uniform")
OVERFLOW_POLICIES = ("spill", "drop", "reroute")
RESIDENCY = ("auto", "npu", "cpu")
DECODE = ("own", "prefill")  # decode on graphs of its own (GroupPlan.decode_experts), or on the groups' prefill graphs
GRAPHS_PER_LAYER = 3  # compiled NPU expert graphs per layer and sequence length, shared by its groups
# Decode graphs per layer at most: a graph per expert gave OLMoE-1B-7B 1,024 of them (64 a layer) and would give
# Qwen3-30B-A3B 6,144, each a compile step and a loaded context or function on the device. The cap comes from the
# target's device records (plan.decode_graph_cap: the graphs' overhead within this share of an app's memory);
# 16 a layer where no device records a per-graph overhead. The decode cost model picks the best sizes within it.
GRAPH_OVERHEAD_SHARE = 0.05
DECODE_GRAPHS_PER_LAYER = 16
