"""npumoe: Mixture-of-Experts LLMs on phone and laptop NPUs.

    m = npumoe.load(dir)            # or npumoe.load() for the shipped demo model
    eng = npumoe.Engine(m)          # plan=..., backend="htp"|"ane", artifacts=...
    eng.forward(ids)                # -> np.ndarray[T, vocab] fp32 logits
    eng.generate(ids, max_new_tokens=16)  # -> np.ndarray of the new ids only
"""

from npumoe.core.runtime.engine import Engine
from npumoe.models.loader import Model, load

__all__ = ["Engine", "Model", "load"]
