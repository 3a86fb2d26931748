"""Errors of the engine integrations.  Each is a :class:`gms.GMSError`; the
engine shows them as the reason it failed to start, to wake or to resume."""

from __future__ import annotations

from ...errors import GMSError


class IntegrationError(GMSError):
    """The base of the integrations' errors."""


class ConfigError(IntegrationError, ValueError):
    """``--model-loader-extra-config`` holds a ``gms_*`` key that is unknown or of the wrong type."""


class MissingWorkerError(IntegrationError):
    """``--load-format gms`` without the rest of the integration (vLLM: its
    ``--worker-cls``; SGLang: the plugin's hooks): the parts only work together."""


class UnsupportedModelError(IntegrationError):
    """A model or option the gms loader does not handle (quantized weights, loading
    onto another device, ...)."""


class LayoutMismatchError(IntegrationError):
    """The committed layout was published for another model, engine version, dtype or
    parallel rank than this engine's."""
