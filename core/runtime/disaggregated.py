"""Disaggregated generation: the prompt on one target, decode on another, the KV cache handed over once.

On a Mac the Neural Engine wins time to first token and the GPU (MLX) time per output token (SqueezeBits,
"Disaggregated inference on Apple Silicon", 2025): so the prompt's chunks run on the prefill target's executors,
the cache it filled moves once to the decode engine (:class:`~npumoe.core.runtime.handoff.KVHandoff`), and every
decode step runs on the decode target's. Both engines run the same model; each target's graphs come from its own
part of a multi-target build (``npumoe build --targets ane,mlx``), the CPU's from the model itself.
"""

from __future__ import annotations

from npumoe.core.base.errors import InputError, whole_number
from npumoe.core.compiler.artifacts import read_manifest, read_targets
from npumoe.core.ir.backend import get_backend, plugin
from npumoe.core.runtime.engine import Engine
from npumoe.core.runtime.metrics import Metrics


class DisaggregatedEngine:
    """``generate(ids, n)``: prefill on ``prefill_on``, hand the cache to ``decode_on``, decode there.
    ``metrics["seconds"]`` splits the time into prefill, handoff and decode; ``prefill`` and ``decode`` are the two
    :class:`~npumoe.core.runtime.engine.Engine` s (each with its own metrics)."""

    def __init__(self, model, prefill_on: str, decode_on: str, artifacts=None, chunk: int | None = None,
                 max_context: int | None = None, prefill_options: dict | None = None):
        """``artifacts``: a multi-target build holding every non-CPU target named (or one target's build, when
        only one is not the CPU). ``chunk`` and ``max_context`` apply where the CPU runs from the model (a built
        target's are its build's). ``prefill_options`` go to the prefill target's backend (the HTP's
        ``profile_dir``)."""
        for role, target in (("--prefill-on", prefill_on), ("--decode-on", decode_on)):
            check_target(role, target, artifacts)
        self.prefill = Engine(model, backend=prefill_on, artifacts=_built(prefill_on, artifacts), chunk=chunk,
                              max_context=max_context, backend_options=prefill_options)
        self.decode = Engine(model, backend=decode_on, artifacts=_built(decode_on, artifacts),
                             max_context=max_context or self.prefill.cache.capacity)
        self.decode.check_takes_kv()
        self.targets = prefill_on, decode_on
        self.metrics_ = Metrics()
        self.last_handoff = None

    @property
    def metrics(self) -> dict:
        """``seconds``: the prefill engine's prefill, the hand-off, the decode engine's decode steps (as
        :attr:`Engine.metrics` times them); ``prefill``, ``decode``: each engine's own metrics."""
        seconds = {"prefill": self.prefill.metrics_.seconds["prefill"], **self.metrics_.seconds,
                   "decode": self.decode.metrics_.seconds["decode"]}
        return {"seconds": seconds, "prefill": self.prefill.metrics, "decode": self.decode.metrics,
                "handoff_bytes": self.last_handoff.nbytes if self.last_handoff else 0}

    def record_spans(self) -> None:
        """Record one timeline (``--trace``): the three phases and each engine's host steps inside them."""
        spans = []
        for m in (self.metrics_, self.prefill.metrics_, self.decode.metrics_):
            m.spans = spans

    def generate(self, ids, max_new_tokens: int = 32, return_logits: bool = False):
        """Greedy decoding from ``ids``, as :meth:`Engine.generate` does on one target: the new tokens only."""
        max_new_tokens = whole_number(max_new_tokens, "max_new_tokens", 0)
        ids = self.prefill.check_generation(ids, max_new_tokens)
        self.decode.check_generation(ids, max_new_tokens)
        logits = self.prefill.prefill_prompt(ids)
        with self.metrics_.time("handoff"):
            self.last_handoff = self.prefill.export_kv()
            self.decode.import_kv(self.last_handoff)
        return self.decode.continue_greedy(logits, max_new_tokens, return_logits)



def check_target(role: str, target: str, artifacts) -> None:
    """``target`` installed and, unless it is the CPU, built in ``artifacts``: refused before any work."""
    plugin(target)  # an unknown name: one line listing the installed ones
    if target == "cpu":
        return
    get_backend(target)  # a toolchain that does not load here: one line saying what to install
    if artifacts is None:
        raise InputError(f"{role} {target} runs built artifacts; pass --artifacts BUILD from npumoe build --targets "
                         f"{target},... (the CPU alone needs none).")
    built = read_targets(artifacts)
    held = list(built["targets"]) if built is not None else [read_manifest(artifacts, verify=False).get("target")]
    if target not in held:
        raise InputError(f"{artifacts} holds builds for {', '.join(map(str, held))}, not {target}; build it too "
                         f"(npumoe build --targets {','.join(map(str, [*held, target]))} ...) or pick {role} among "
                         "those.")


def _built(target: str, artifacts):
    return None if target == "cpu" else artifacts
