"""Errors of the vLLM integration.  Each is a :class:`gms.GMSError`; vLLM
shows them as the reason an engine failed to start or to wake."""

from __future__ import annotations

from ...errors import GMSError


class GmsVllmError(GMSError):
    """The base of this package's errors."""


class ConfigError(GmsVllmError, ValueError):
    """``--model-loader-extra-config`` holds a ``gms_*`` key that is unknown or of the wrong type."""


class MissingWorkerError(GmsVllmError):
    """``--load-format gms`` without ``--worker-cls gms.integrations.vllm.worker.GMSWorker``
    (or the other way round): the two only work together."""


class UnsupportedModelError(GmsVllmError):
    """A model or option the gms loader does not handle (quantized weights, loading
    onto another device, ...)."""


class LayoutMismatchError(GmsVllmError):
    """The committed layout was published for another model, vLLM version, dtype or
    parallel rank than this engine's."""
