"""The host runtime: the Engine, one MoE layer's route, dispatch and combine, residency, calibration.

The prefill chunk the CLI offers by default is defined here, beside nothing heavy, so `npumoe generate --help`
needs no torch.
"""

DEFAULT_CHUNK = 64
