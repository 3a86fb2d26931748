"""vLLM on gms (``pip install 'gms[vllm]'``; docs/vllm.md).

::

    vllm serve MODEL --load-format gms \\
        --worker-cls gms.integrations.vllm.worker.GMSWorker \\
        [--model-loader-extra-config '{"gms_read_only": true}']

* The first engine on a GPU loads the model from disk into gms and
  publishes it; every later one (another replica, a shadow, a restarted
  engine) maps the published weights: one copy on the GPU, no disk reads.
* The KV cache lives in a gms layout of the engine's own.
* ``POST /sleep`` and ``POST /wake_up`` unmap and remap both, at the same
  addresses, so CUDA graphs captured before a sleep replay after it.

vLLM finds this package through its plugin entry points (pyproject.toml):
``vllm.general_plugins`` runs ``register`` in every vLLM process, and
``vllm.endpoint_plugins`` offers ``GET /gms/health`` (``endpoints.py``) to servers
that allow it (``VLLM_PLUGINS=gms``).

What every engine shares is in ``gms.integrations.common``: ``config`` (the
``gms_*`` keys), ``names`` (layout names and the published identity),
``memory`` (the layouts, sleep and wake), ``parent`` (exit with the API
server).  Here ``memory`` (finding the worker's) and ``surface`` (every
name taken from vLLM, and the check of a release against them) need no
vLLM; ``loader``, ``worker``, ``sleep`` and ``endpoints`` import it.
"""

from __future__ import annotations

import logging

# Under vLLM's "vllm" logger, whose handler vLLM configures in each of its
# processes: the plugin's lines then appear in the engine's log, formatted
# and filtered (VLLM_LOGGING_LEVEL) like vLLM's own.
LOGGER = "vllm.gms"
log = logging.getLogger(LOGGER)

_registered = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: add the ``gms`` load format and the
    ``gms`` sleep-mode backend to vLLM's registries.  vLLM may call it more than
    once per process; only the first call registers."""
    global _registered
    if _registered:
        return
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    from vllm.model_executor.model_loader import register_model_loader

    from .loader import LOAD_FORMAT, GMSModelLoader
    from .sleep import NAME

    register_model_loader(LOAD_FORMAT)(GMSModelLoader)
    try:
        SleepModeBackendFactory.register_backend(NAME, "gms.integrations.vllm.sleep", "GMSSleepBackend")
    except ValueError:  # registered already, by an earlier import of this package
        pass
    # The shared modules log under "gms.integrations": into vLLM's handlers too,
    # which only its own logger has.
    shared, ours = logging.getLogger("gms.integrations"), logging.getLogger("vllm")
    for handler in ours.handlers:
        if handler not in shared.handlers:
            shared.addHandler(handler)
    if ours.handlers:
        shared.setLevel(ours.getEffectiveLevel())
        shared.propagate = False
    _registered = True
