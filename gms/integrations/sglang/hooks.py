"""Every change this plugin makes to SGLang, through SGLang's ``HookRegistry``
(``sglang.srt.plugins.hook_registry``), in one table.

Targets are SGLang's names as of 0.5.17; ``tests/test_sglang.py`` checks each
one against the SGLang installed, so a release that moves one fails there,
not in a user's engine.  The functions import nothing from SGLang at module
level (nor torch): SGLang calls them with its own objects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from . import gate, generations, health, process
from .process import LOAD_FORMAT


@attrs.frozen
class Hook:
    target: str  # SGLang's dotted name
    kind: str  # HookType's value: "before", "after", "around"
    function: Callable
    why: str


def load_format_is_the_loader(original, self, *args, **kwargs):
    """``LoadConfig`` checks its format against SGLang's enum; ``gms`` becomes the
    loader class, which ``get_model_loader`` instantiates as it is."""
    if self.load_format == LOAD_FORMAT:
        from .loader import GMSModelLoader

        self.load_format = GMSModelLoader
        return None
    return original(self, *args, **kwargs)


def note_launcher(result, self, *args, **kwargs) -> None:
    """The launcher's ``ServerArgs``: a wrong ``gms_*`` key fails at start-up, and
    the launcher's own memory saver (it only configures children) is gms's."""
    process.activate(self)


def note_scheduler(self, *args, **kwargs) -> None:
    """A scheduler process (one per GPU rank): its server args and its GPU.
    Two generations of SGLang's API: ``Scheduler(server_args, port_args, gpu_id,
    ...)`` (0.5.11 to 0.5.17), and ``Scheduler(server_args, port_args)`` with the
    GPU in the process's runtime context (0.5.23: ``get_device().gpu_id``, read
    from the wheel; not yet run on a GPU: docs/sglang.md)."""
    server_args = kwargs["server_args"] if "server_args" in kwargs else args[0]
    gpu_id = kwargs["gpu_id"] if "gpu_id" in kwargs else (args[2] if len(args) > 2 else generations.context_gpu())
    process.activate(server_args, int(gpu_id))


def memory_saver(original, *args, **kwargs) -> Any:
    """gms's memory saver where ``--load-format gms --enable-memory-saver``; SGLang's elsewhere."""
    from .saver import saver_for  # torch: only where SGLang asks for a saver

    enable = kwargs["enable"] if "enable" in kwargs else (args[0] if args else False)
    return saver_for(bool(enable)) or original(*args, **kwargs)


_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler.__init__"
_TOKENIZER = "sglang.srt.managers.tokenizer_control_mixin.TokenizerControlMixin"
HOOKS = (
    Hook("sglang.srt.configs.load_config.LoadConfig._verify_load_format", "around", load_format_is_the_loader,
         "--load-format gms names the gms loader class"),
    Hook("sglang.srt.server_args.ServerArgs.__post_init__", "after", note_launcher,
         "the launcher knows gms is on (and refuses a bad gms_* key at once)"),
    Hook(_SCHEDULER, "before", note_scheduler, "each scheduler knows gms is on, and its GPU"),
    Hook("sglang.srt.utils.torch_memory_saver_adapter.TorchMemorySaverAdapter.create", "around", memory_saver,
         "the memory saver's regions, graphs, release and resume go to gms"),
    Hook(f"{_TOKENIZER}.release_memory_occupation", "around", gate.release,
         "a released engine holds its requests (a prefill on unmapped memory kills SGLang's scheduler); "
         "GET /gms/health says asleep"),
    Hook(f"{_TOKENIZER}.resume_memory_occupation", "around", gate.resume,
         "... until the resume, which lets them go; /gms/health says serving"),
    Hook("sglang.srt.entrypoints.http_server.launch_server", "before", health.add_route,
         "GET /gms/health on SGLang's HTTP server, for the failover coordinator"),
)
