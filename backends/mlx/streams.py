"""MLX's devices by the name the mlx target's options use, and each thread's stream on them: MLX streams belong to
the thread that made them, and the engine runs graphs on several."""

from __future__ import annotations

import threading

import mlx.core as mx

DEVICES = {"gpu": mx.gpu, "cpu": mx.cpu}
_streams = threading.local()


def stream(device: str) -> mx.Stream:
    """This thread's MLX stream on ``device``, made on first use."""
    made = _streams.__dict__.setdefault("by_device", {})
    if device not in made:
        made[device] = mx.new_stream(DEVICES[device])
    return made[device]
