"""The vocabulary every layer shares: ModelSpec, the graph IR, weights and tensor files, identity, the backend
contract.

What the CLI offers as choices is defined here, beside nothing heavy, so `npumoe X --help` needs no torch.
"""

DTYPE_POLICIES = ("auto", "float32", "bfloat16", "float16")  # how weights.Weights computes (see there)
