"""This process's gms state under SGLang: whether ``--load-format gms`` is on,
with what configuration and on which GPU, and the ``EngineMemory`` once the
loader made it.

Set by the hooks (``hooks.py``) from what SGLang hands its own code: the
launcher's ``ServerArgs`` and each scheduler's ``gpu_id``.  Pure data and
functions of it; no SGLang imported.
"""

from __future__ import annotations

from typing import Any

import attrs

from ...system.paths import socket_path
from ..common import config as gms_config
from ..common.config import EngineConfig
from ..common.parent import exit_with_parent

LOAD_FORMAT = "gms"


@attrs.frozen
class Active:
    """``--load-format gms`` in this process."""

    config: EngineConfig
    memory_saver: bool  # --enable-memory-saver: the KV cache (and graphs) in gms, release and resume
    device: int | None = None  # the scheduler's GPU; None in the launcher

    @property
    def socket(self) -> str:
        if self.device is None:
            raise RuntimeError("the launcher has no GPU of its own")
        return self.config.socket_for(self.device) or socket_path(self.device)


_active: Active | None = None


def activate(server_args: Any, device: int | None = None) -> Active | None:
    """Note ``server_args`` (SGLang's): active if its load format is ``gms``.
    A ``gms_*`` key that is wrong fails here, at start-up."""
    global _active
    if getattr(server_args, "load_format", None) != LOAD_FORMAT:
        return None
    config, _ = gms_config.parse(getattr(server_args, "model_loader_extra_config", None))
    _active = Active(config, bool(getattr(server_args, "enable_memory_saver", False)), device)
    if config.exit_with_parent and device is not None:
        exit_with_parent()
    return _active


def active() -> Active | None:
    return _active


def deactivate() -> None:
    """For tests."""
    global _active
    _active = None
