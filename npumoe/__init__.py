"""npumoe: Mixture-of-Experts LLMs on phone and laptop NPUs.

    m = npumoe.load(dir)            # or npumoe.load() for the shipped demo model
    eng = npumoe.Engine(m)          # plan=..., backend="htp"|"ane", artifacts=...
    eng.forward(ids)                # -> np.ndarray[T, vocab] fp32 logits
    eng.generate(ids, max_new_tokens=16)  # -> np.ndarray of the new ids only
    npumoe.DisaggregatedEngine(m, "ane", "mlx", artifacts=build)  # prefill there, decode here, KV handed over once

    profile = npumoe.calibrate(m, texts, chunk=256)       # how the experts are really used
    p = npumoe.plan(m, profile, target="htp", overflow="spill")
    npumoe.Engine(m, plan=p)                               # static groups, same logits
    profile.save(path); npumoe.RoutingProfile.load(path); p.save(path); npumoe.Plan.load(path)
"""

from npumoe.core.base.errors import (
    ArtifactError,
    BackendUnavailableError,
    InputError,
    ModelDirError,
    NpumoeError,
    NumericError,
    UnsupportedModelError,
    WeightError,
)

# imported on first use (PEP 562): `import npumoe.cli` must not import torch just to print `npumoe --help`
_LAZY = {
    "DisaggregatedEngine": "npumoe.core.runtime.disaggregated",
    "Engine": "npumoe.core.runtime.engine",
    "Model": "npumoe.models.loader",
    "Plan": "npumoe.core.planning.plan",
    "RoutingProfile": "npumoe.core.planning.profile",
    "calibrate": "npumoe.core.runtime.calibrate",
    "load": "npumoe.models.loader",
    "plan": "npumoe.core.planning.plan",
}

__all__ = ["DisaggregatedEngine", "Engine", "Model", "Plan", "RoutingProfile", "calibrate", "load", "plan",
           "NpumoeError", "ArtifactError", "BackendUnavailableError", "InputError", "ModelDirError", "NumericError",
           "UnsupportedModelError", "WeightError"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'npumoe' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
