"""SGLang on gms (``pip install 'gms[sglang]'``; docs/sglang.md).

::

    python -m sglang.launch_server --model-path M --load-format gms --enable-memory-saver \\
        [--model-loader-extra-config '{"gms_read_only": true}']

* The first engine on a GPU loads the model from disk (SGLang's own loader)
  into gms and publishes it; every later one (a replica, a shadow, the same
  engine restarted) maps the published weights: one copy, no disk reads.
* With ``--enable-memory-saver`` the KV cache lives in a gms layout of the
  engine's own, and so do the CUDA graphs' buffers where SGLang puts graphs
  under its memory saver (``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1``).
* ``/release_memory_occupation`` and ``/resume_memory_occupation`` unmap and
  remap them at the same addresses (weights as published, the rest as fresh
  memory), so CUDA graphs captured before a release replay after it.

SGLang finds this package by its ``sglang.srt.plugins`` entry point
(pyproject.toml): ``load_plugins()`` runs ``register`` in every SGLang
process (the launcher, each scheduler) before anything is built.  Every
change to SGLang goes through its ``HookRegistry`` and is listed in
``HOOKS`` (``hooks.py``): nothing else is patched.

Modules: ``hooks`` (what is hooked, and why), ``process`` (this process's
gms state), ``saver`` (the memory saver over gms), ``loader`` (the load
format), ``health`` (``GET /gms/health`` for the failover coordinator).
Only ``loader`` and ``health`` import SGLang at import time.
"""

from __future__ import annotations

import logging

LOGGER = "sglang.gms"  # under SGLang's logger: its handlers and level apply
log = logging.getLogger(LOGGER)

_registered = False


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: add ``gms`` to ``--load-format``'s
    choices and register the hooks.  Only the first call in a process acts."""
    global _registered
    if _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import LOAD_FORMAT_CHOICES, add_load_format_choices

    from .hooks import HOOKS
    from .process import LOAD_FORMAT

    if LOAD_FORMAT not in LOAD_FORMAT_CHOICES:
        add_load_format_choices([LOAD_FORMAT])
    for hook in HOOKS:
        HookRegistry.register(hook.target, hook.function, HookType(hook.kind))
    _registered = True
