"""Every name the vLLM plugin takes from vLLM, in one table, and the check of a
release's API against it.

A release passes when each use is found where the plugin looks and in the
form it uses it: a function called with the arguments the plugin passes, a
method overridden with vLLM's own parameters, a class subclassed with no
abstract method left unimplemented, a dataclass field set, a constant.

``scripts/vllm_surface.py`` reads a release's wheel (its Python source, with
``ast``; nothing imported) into a *surface*: for each use, what that release
has there.  The surfaces of every release in ``gms[vllm]``'s range are kept
in ``tests/data/vllm_surface/`` and checked in CI (``tests/test_vllm.py``),
so a range is exactly what was checked.  Pure: no vLLM, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

# The plugin's range: every release here was checked (docs/vllm.md says which ran on a GPU).
RELEASES = ("0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")


@attrs.frozen
class Use:
    module: str
    name: str  # "f", "Class", "Class.method"
    kind: str  # "call", "override", "subclass", "field", "constant", "defined"
    # call: the positional count and keywords passed; override: vLLM's parameters, as the plugin declares them;
    # subclass: the methods the plugin's subclass defines; constant: the value.
    positional: int = 0
    keywords: tuple[str, ...] = ()
    params: tuple[str, ...] = ()
    defines: tuple[str, ...] = ()
    value: str = ""

    @property
    def key(self) -> str:
        return f"{self.module}:{self.name}"


_LOADER = "vllm.model_executor.model_loader"
_WORKER = "vllm.v1.worker.gpu_worker"
_SLEEP = "vllm.device_allocator.sleep_mode_backend"
USES = (
    Use("vllm.plugins", "DEFAULT_PLUGINS_GROUP", "constant", value="vllm.general_plugins"),
    Use("vllm.plugins", "ENDPOINT_PLUGINS_GROUP", "constant", value="vllm.endpoint_plugins"),
    Use("vllm.plugins.endpoint_plugins.interface", "EndpointPlugin.attach_router", "override", params=("app",)),
    Use("vllm.plugins.endpoint_plugins.interface", "EndpointPlugin.init_state", "override",
        params=("engine_client", "state", "args")),
    Use(_LOADER, "register_model_loader", "call", positional=1),
    Use(f"{_LOADER}.base_loader", "BaseModelLoader", "subclass",
        defines=("__init__", "download_model", "load_weights", "load_model")),
    Use(f"{_LOADER}.base_loader", "BaseModelLoader.load_model", "override",
        params=("vllm_config", "model_config", "prefix")),
    Use(f"{_LOADER}.base_loader", "BaseModelLoader.load_weights", "override", params=("model", "model_config")),
    Use(f"{_LOADER}.base_loader", "BaseModelLoader.download_model", "override", params=("model_config",)),
    Use(f"{_LOADER}.default_loader", "DefaultModelLoader", "call", positional=1),
    Use(f"{_LOADER}.default_loader", "DefaultModelLoader.load_model", "call",
        keywords=("vllm_config", "model_config", "prefix")),
    Use(f"{_LOADER}.default_loader", "DefaultModelLoader.download_model", "call", positional=1),
    Use(f"{_LOADER}.utils", "initialize_model", "call", keywords=("vllm_config", "model_config", "prefix")),
    Use(f"{_LOADER}.utils", "process_weights_after_loading", "call", positional=3),
    Use("vllm.utils.torch_utils", "set_default_torch_dtype", "call", positional=1),
    Use("vllm.config", "ModelConfig", "defined"),
    Use("vllm.config", "VllmConfig", "defined"),
    Use("vllm.config.load", "LoadConfig", "defined"),
    Use("vllm.config.model", "ModelConfig.sleep_mode_backend", "field"),
    Use("vllm.distributed", "get_pp_group", "call"),
    Use("vllm.distributed", "get_tensor_model_parallel_rank", "call"),
    Use("vllm.distributed", "get_tensor_model_parallel_world_size", "call"),
    Use("vllm.utils.mem_utils", "MemorySnapshot", "call", keywords=("device",)),
    Use("vllm.v1.worker.utils", "request_memory", "call", positional=2),
    Use(_WORKER, "Worker", "subclass", defines=("__init__", "init_device", "_maybe_get_memory_pool_context")),
    Use(_WORKER, "Worker.init_device", "override"),
    Use(_WORKER, "Worker._maybe_get_memory_pool_context", "override", params=("tag",)),
    Use(_SLEEP, "SleepModeBackend", "subclass",
        defines=("suspend", "resume", "preserves_communicators", "preserves_compiled_artifacts")),
    Use(_SLEEP, "SleepModeBackend.suspend", "override", params=("level",)),
    Use(_SLEEP, "SleepModeBackend.resume", "override", params=("tags",)),
    Use(_SLEEP, "SleepModeBackendFactory.register_backend", "call", positional=3),
    Use("vllm", "SamplingParams", "defined"),
    Use("vllm.sampling_params", "SamplingParams", "call", keywords=("max_tokens", "temperature", "ignore_eos")),
    Use("vllm.engine.protocol", "EngineClient.check_health", "call"),
    Use("vllm.engine.protocol", "EngineClient.is_sleeping", "call"),
    Use("vllm.engine.protocol", "EngineClient.generate", "call", positional=3),
    # The metrics GET /gms/health reads its progress from (progress.py).
    *(Use("vllm.v1.metrics.loggers", metric, "defined") for metric in (
        "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_requests_running", "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc")),
)


def problems(use: Use, found: Mapping | None) -> list[str]:
    """What keeps ``use`` from working against what a release has (``found``,
    the extractor's record for it; None: not found).  Pure."""
    if not found:
        return [f"{use.key}: not found"]
    out: list[str] = []
    params = found.get("params")  # [(name, kind, has_default)] without self/cls; None for a class
    if use.kind == "call" and params is not None:
        positional = [p for p in params if p[1] in ("positional", "either")]
        names = {p[0] for p in params}
        takes_var_kw = any(p[1] == "var_keyword" for p in params)
        takes_var_pos = any(p[1] == "var_positional" for p in params)
        if use.positional > len(positional) and not takes_var_pos:
            out.append(f"{use.key}: takes {len(positional)} positional arguments, the plugin passes {use.positional}")
        for kw in use.keywords:
            if kw not in names and not takes_var_kw:
                out.append(f"{use.key}: no parameter {kw!r}")
        passed = {p[0] for p in positional[:use.positional]} | set(use.keywords)
        missing = [p[0] for p in params if not p[2] and p[1] in ("either", "positional", "keyword")
                   and p[0] not in passed]
        if missing:
            out.append(f"{use.key}: requires {', '.join(missing)}, which the plugin does not pass")
    elif use.kind == "override":
        theirs = tuple(p[0] for p in params or () if p[1] not in ("var_positional", "var_keyword"))
        if theirs != use.params:
            out.append(f"{use.key}: vLLM's parameters are {theirs}, the plugin overrides with {use.params}")
    elif use.kind == "subclass":
        left = sorted(set(found.get("abstract", ())) - set(use.defines))
        if left:
            out.append(f"{use.key}: abstract {', '.join(left)} not implemented by the plugin")
    elif use.kind == "constant" and found.get("value") != use.value:
        out.append(f"{use.key}: is {found.get('value')!r}, the plugin expects {use.value!r}")
    return out


def check(surface: Mapping[str, Mapping]) -> list[str]:
    """Every problem of a release (its surface: use key -> found) for the plugin."""
    return [p for use in USES for p in problems(use, surface.get(use.key))]
