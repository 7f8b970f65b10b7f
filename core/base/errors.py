"""Typed errors with one clear sentence each: what is wrong and how to fix it.

The CLI prints ``str(err)`` and exits 2 for any :class:`NpumoeError`; nothing else
should reach a user as a traceback.
"""

import operator


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


def whole_number(value, what: str, least: int) -> int:
    """``value`` as an int if it is a whole number (numpy and torch integers too, never a bool) ≥ ``least``;
    otherwise an InputError naming ``what``: a library caller's 2.5 or -3 must not reach range() or torch."""
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None or isinstance(value, bool) or number < least:
        raise InputError(f"{what} must be a whole number ≥ {least}, got {value!r:.40}.")
    return number
