"""Typed errors with one clear sentence each: what is wrong and how to fix it.

The CLI prints ``str(err)`` and exits 2 for any :class:`NpumoeError`; nothing else
should reach a user as a traceback.
"""


class NpumoeError(Exception):
    """Base class: a problem with the user's input or environment, not a bug."""


class ModelDirError(NpumoeError):
    """The model directory or its config.json is missing or unreadable."""


class UnsupportedModelError(NpumoeError):
    """The config's ``model_type`` (or one of its options) has no adapter."""


class WeightError(NpumoeError):
    """A tensor is missing, misshaped, or stored in a format npumoe refuses (pickles)."""


class InputError(NpumoeError):
    """A prompt, token id or option value that cannot be run."""


class ArtifactError(NpumoeError):
    """A profile, plan or built artifact that does not belong to this model or was altered."""


class NumericError(NpumoeError):
    """NaN or Inf where the model's hidden states or logits belong: non-finite weights or a dtype overflow."""


class BackendUnavailableError(NpumoeError):
    """A backend's toolchain is not installed or cannot run on this machine."""
