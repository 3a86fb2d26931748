"""The ``gms_*`` keys of ``--model-loader-extra-config``, read into frozen data.

::

    --model-loader-extra-config '{"gms_read_only": true, "gms_lock_timeout_s": 60}'

==========================  =======  ==========================================================
key                         default  meaning
==========================  =======  ==========================================================
``gms_read_only``           false    import only (``RO``): never load from disk, wait for a
                                     writer's commit instead of becoming one (``RW_OR_RO``)
``gms_socket``              the      the GPU's gms server; ``{device}`` is replaced by the
                            GPU's    worker's CUDA ordinal (tensor parallel: one server per GPU)
``gms_layout``              derived  the weights' layout name (rank suffix added under TP/PP)
``gms_kv_layout``           derived  the KV cache's layout name (the same suffix); must differ
                                     between engines that are awake together
``gms_lock_timeout_s``      none     how long to wait for a lock (``none``: for ever)
``gms_load_format``         "auto"   what the first engine reads from disk (the engine's own format)
``gms_residency``           device   the committed weights' residency (device, system, unpinned;
                                     docs/operations.md)
``gms_exit_with_parent``    true     the worker exits at once when the process that started
                                     it dies, so its GPU memory comes back
==========================  =======  ==========================================================

vLLM and SGLang both take the keys through ``--model-loader-extra-config``.
Other keys go to the engine's loader that reads from disk (vLLM's default
loader takes ``enable_multithread_load``, ``num_threads``, ...).  An unknown
``gms_*`` key is an error: a typo must not silently mean the default.
Pure: no engine, no I/O.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

import attrs

from .errors import ConfigError

PREFIX = "gms_"
RESIDENCIES = ("device", "system", "unpinned")


def _optional_str(value: Any, key: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{key} must be a non-empty string, not {value!r}")
    return value


def _bool(value: Any, key: str) -> bool:
    # JSON gives real booleans; "false" as a string would be truthy, so it is refused.
    if not isinstance(value, bool):
        raise ConfigError(f"{key} must be true or false, not {value!r}")
    return value


def _timeout(value: Any, key: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ConfigError(f"{key} must be a number of seconds >= 0 or null, not {value!r}")
    return float(value)


@attrs.frozen
class EngineConfig:
    read_only: bool = False
    socket: str | None = None
    layout: str | None = None
    kv_layout: str | None = None
    lock_timeout_s: float | None = None
    load_format: str = "auto"
    residency: str = "device"
    exit_with_parent: bool = True

    @property
    def lock_timeout_ms(self) -> int | None:
        return None if self.lock_timeout_s is None else int(self.lock_timeout_s * 1000)

    def socket_for(self, device: int) -> str | None:
        """This worker's server socket, or None for the GPU's default (gms.socket_path)."""
        return None if self.socket is None else self.socket.replace("{device}", str(device))


_READERS = {
    "read_only": _bool,
    "socket": _optional_str,
    "layout": _optional_str,
    "kv_layout": _optional_str,
    "lock_timeout_s": _timeout,
    "exit_with_parent": _bool,
}


def parse(extra: Mapping[str, Any] | str | None) -> tuple[EngineConfig, dict[str, Any]]:
    """``(gms config, the other keys)`` from a model loader's extra config (a mapping,
    or the flag's JSON text as an engine's server arguments keep it)."""
    if extra is None or extra == "":
        extra = {}
    if isinstance(extra, str):
        try:
            extra = json.loads(extra)
        except ValueError as exc:
            raise ConfigError(f"--model-loader-extra-config is not JSON: {exc}") from None
    if not isinstance(extra, Mapping):
        raise ConfigError(f"--model-loader-extra-config must be a JSON object, not {type(extra).__name__}")
    fields: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in extra.items():
        if not isinstance(key, str) or not key.startswith(PREFIX):
            rest[key] = value
            continue
        name = key[len(PREFIX):]
        if name in _READERS:
            fields[name] = _READERS[name](value, key)
        elif name == "load_format":
            if not isinstance(value, str) or not value or value.lower() == "gms":
                raise ConfigError(f"{key} names the format read from disk (auto, safetensors, ...), not {value!r}")
            fields[name] = value.lower()
        elif name == "residency":
            if value not in RESIDENCIES:
                raise ConfigError(f"{key} must be one of {', '.join(RESIDENCIES)}, not {value!r}")
            fields[name] = value
        else:
            known = ", ".join(PREFIX + k for k in sorted([*_READERS, "load_format", "residency"]))
            raise ConfigError(f"unknown key {key!r} in --model-loader-extra-config (known: {known})")
    return EngineConfig(**fields), rest


def for_disk(load_config: Any) -> tuple[EngineConfig, Any]:
    """``(the gms keys, the engine's load config for what the first engine reads
    from disk)``: the engine's own loader with the format and the extra keys
    that are not ours.  ``load_config`` is the engine's (a dataclass)."""
    gms, rest = parse(load_config.model_loader_extra_config)
    return gms, dataclasses.replace(load_config, load_format=gms.load_format, model_loader_extra_config=rest)
