"""SGLang's memory saver over gms: what ``TorchMemorySaverAdapter.create``
returns in a process serving ``--load-format gms --enable-memory-saver``.

SGLang asks its memory saver for three things, each by tag (``weights``,
``kv_cache``, ``cuda_graph``): a *region* in which tensors are made, a CUDA
graph *capture* whose private memory is the saver's, and *pause* / *resume*.
torch_memory_saver (SGLang's own) answers with memory it allocates and frees
itself; this answers with gms layouts:

* ``weights``: nothing to do in the region (the gms loader places the
  weights: allocated in gms by the first engine, mapped by every later one);
  pause unmaps them and drops the read lock; resume maps the committed layout
  back at the same addresses, **contents kept** (no reload, no copy).
* ``kv_cache``: the region's tensors live in this engine's own RW layout;
  pause unmaps them and the layout goes with its lock; resume makes fresh
  memory at the same addresses.
* ``cuda_graph``: the captures' private pool is a pool over this engine's own
  graph layout, so the graphs' buffers are released and re-made like the KV
  cache; every graph replays after a resume (its buffers, the weights and the
  KV cache are back at their addresses).

One saver per process, shared by every caller (SGLang makes an adapter in
several places).  No SGLang imported: it is given SGLang's calls only.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch

from ... import torch as gms_torch
from ..common import names
from ..common.errors import UnsupportedModelError
from ..common.memory import CUDA_GRAPH, KV_CACHE, WEIGHTS, EngineMemory, current
from .process import active

log = logging.getLogger("sglang.gms")  # see LOGGER in __init__.py
TAGS = (WEIGHTS, KV_CACHE, CUDA_GRAPH)
MISSING = "--load-format gms: the gms loader has not run in this process (docs/sglang.md)"



def _no_host_copy(tag: str, asked: bool) -> None:
    """A scratch region is remade, never copied back: a host copy asked of it is said, ignored."""
    if asked:
        log.warning("gms: the %s region keeps no host copy (enable_cpu_backup is ignored)", tag)


class GMSMemorySaver:
    """The methods and property SGLang's ``TorchMemorySaverAdapter`` has."""

    def __init__(self) -> None:
        self._graph_pool: torch.cuda.MemPool | None = None

    @property
    def enabled(self) -> bool:
        return True

    def check_validity(self, caller_name: str) -> None:
        pass

    def configure_subprocess(self) -> contextlib.AbstractContextManager:
        # torch_memory_saver preloads its allocator into SGLang's children; gms needs nothing there.
        return contextlib.nullcontext()

    def disable(self) -> contextlib.AbstractContextManager:
        raise UnsupportedModelError("the gms memory saver has no disable(): allocations in a gms region "
                                    "always go to gms (docs/sglang.md)")

    # -- regions and captures ------------------------------------------------------------

    @contextlib.contextmanager
    def region(self, tag: str, enable_cpu_backup: bool = False) -> Iterator[None]:
        _known(tag)
        if tag != WEIGHTS:
            _no_host_copy(tag, enable_cpu_backup)
        if tag == WEIGHTS:  # the loader places them (loader.py)
            yield
            return
        mgr = _scratch(current(MISSING), tag)
        with gms_torch.without_expandable_segments(), gms_torch.use_memory(mgr, tag=tag):
            yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph: torch.cuda.CUDAGraph, pool=None, stream=None, tag: str = CUDA_GRAPH,
                   **kwargs) -> Iterator[None]:
        """A capture whose private memory is gms memory (``pool`` is SGLang's shared
        graph pool: every graph here shares this saver's one pool instead)."""
        # SGLang 0.5.23 asks its saver for a host copy of graph memory (torch's graph
        # takes no such word): gms keeps none, as for a region.
        _no_host_copy(tag, kwargs.pop("enable_cpu_backup", False))
        mgr = _scratch(current(MISSING), tag)
        if self._graph_pool is None:
            self._graph_pool = gms_torch.memory_pool(mgr)
        # Relaxed: the pool's first segments are mapped during the capture (an
        # import, a reservation and a map, none of them a stream operation).
        kwargs.setdefault("capture_error_mode", "relaxed")
        with gms_torch.without_expandable_segments(), gms_torch.routed(mgr, tag), \
                torch.cuda.graph(cuda_graph, pool=self._graph_pool.id, stream=stream, **kwargs):
            yield

    # -- release and resume ----------------------------------------------------------------

    def pause(self, tag: str) -> None:
        _known(tag)
        memory = current(MISSING)
        if tag == WEIGHTS or tag in memory.scratch:
            memory.sleep([tag])
            log.info("gms: %s released (%.3f s)", tag, memory.timings["sleep_s"])

    def resume(self, tag: str) -> None:
        _known(tag)
        memory = current(MISSING)
        if tag in memory.asleep:
            memory.wake([tag])
            log.info("gms: %s resumed (%.3f s)", tag, memory.timings["wake_s"])


def _known(tag: str) -> None:
    if tag not in TAGS:
        raise ValueError(f"SGLang memory tag {tag!r}: gms knows {', '.join(TAGS)}")


def _scratch(memory: EngineMemory, tag: str):
    """This engine's RW layout for ``tag``, made and locked on first use."""
    if tag not in memory.scratch:
        override = memory.config.kv_layout if tag == KV_CACHE else None
        memory.add_scratch(tag, names.scratch_layout(memory.identity, tag, os.getpid(), override))
    return memory.connect_scratch(tag)


_saver: GMSMemorySaver | None = None


def saver_for(enable: bool) -> GMSMemorySaver | None:
    """The saver SGLang gets in this process, or None where SGLang's own applies."""
    global _saver
    state = active()
    if not enable or state is None or not state.memory_saver:
        return None
    if _saver is None:
        _saver = GMSMemorySaver()
    return _saver
