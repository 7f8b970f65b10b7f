"""npumoe: Mixture-of-Experts LLMs on phone and laptop NPUs.

    m = npumoe.load(dir)            # or npumoe.load() for the shipped demo model
    eng = npumoe.Engine(m)          # plan=..., backend="htp"|"ane", artifacts=...
    eng.forward(ids)                # -> np.ndarray[T, vocab] fp32 logits
    eng.generate(ids, max_new_tokens=16)  # -> np.ndarray of the new ids only

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
from npumoe.core.planning.plan import Plan, plan
from npumoe.core.planning.profile import RoutingProfile
from npumoe.core.runtime.calibrate import calibrate
from npumoe.core.runtime.engine import Engine
from npumoe.models.loader import Model, load

__all__ = ["Engine", "Model", "Plan", "RoutingProfile", "calibrate", "load", "plan",
           "NpumoeError", "ArtifactError", "BackendUnavailableError", "InputError", "ModelDirError", "NumericError",
           "UnsupportedModelError", "WeightError"]
