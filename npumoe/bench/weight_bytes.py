"""Weight bytes one decode token reads as npumoe holds a model: what `bench cpu` and `bench scale` set decode
rates against."""

import math


def npumoe_decode_bytes(model) -> int:
    """Weight bytes one decode token reads as npumoe holds them: every matrix but the embedding (one row),
    and top-k of E experts per layer; packed experts at their packed size."""
    weights, spec = model.weights, model.spec
    packed = getattr(weights, "packed", {})
    total = 0.0
    for name in weights:
        if name == "embed.weight":
            continue
        if name in packed:
            size = sum(b.nbytes for b in packed[name].buffers())
        else:
            size = math.prod(weights.source(name).shape) * (4 if len(weights.source(name).shape) == 1 else
                                                            weights.dtype.itemsize)
        if ".experts." in name:
            moe = spec.layers[int(name.split(".")[1])].ffn
            size *= moe.router.top_k / moe.num_experts
        total += size
    return int(total)
