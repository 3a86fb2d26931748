"""The engine proper: weights from gms, a KV cache in gms, greedy generation,
sleep and wake.  Every method blocks; the HTTP layer runs them one at a time
in a worker thread (``Engine`` itself is not thread-safe).

Weights: ``RW_OR_RO`` on the ``weights`` layout.  The first engine on a GPU is
granted RW, streams the safetensors checkpoint into gms and commits; every
later one (a shadow, a restarted engine) is granted RO and imports the
published tensors without touching the checkpoint.

Phases: starting -> serving | asleep; serving -> sleeping -> asleep;
asleep -> waking -> serving.  ``GMS_MODE=shadow`` ends its start asleep, with
no KV cache: the cache is made on its first wake.

A restart of the gms server under a serving engine breaks nothing it is
using: the memory it mapped stays alive.  ``check_gms`` (the canary runs it)
takes its locks back: the weights ride through to the same layout, the KV
cache gets fresh memory at its addresses.  Until then, or if the weights'
layout is gone, the engine serves from the memory it has and says so.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from engine_kv import GmsKvCache, KvShape
from engine_options import EngineOptions
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, StaticCache

import gms.torch
from gms import (
    BuildLostError,
    GMSClientMemoryManager,
    GMSError,
    GMSUsageError,
    GrantedLockType,
    RequestedLockType,
    SessionEndedError,
    StaleMemoryLayoutError,
)
from gms.client.probes import get_runtime_state

log = logging.getLogger("engine")
PREFIX = "model/"


class EngineError(Exception):
    """A request the engine cannot serve in its current phase (HTTP 503)."""


class BadRequest(ValueError):
    """A request that can never be served as asked (HTTP 400)."""


def _timeout_ms(seconds: float | None) -> int | None:
    return None if seconds is None else int(seconds * 1000)


class Engine:
    def __init__(self, options: EngineOptions) -> None:
        self.options = options
        self.phase = "starting"
        # Managers early: creating one makes room in the fd table (docs/client.md).
        self.weights = GMSClientMemoryManager(options.gms_socket, device=options.device, layout="weights")
        self.kv_mgr = GMSClientMemoryManager(options.gms_socket, device=options.device, layout="kv_cache")
        self.kv: GmsKvCache | None = None
        self.model = None
        self.tokenizer = None
        self.loaded_from_disk = False
        self.timings: dict[str, float] = {}
        # Per layout, what happened to its gms connection since the last wake (none: nothing).
        self.gms_notes: dict[str, str] = {}
        self.steps = 0  # forward passes done: the progress the coordinator watches

    # -- start --------------------------------------------------------------

    def start(self) -> None:
        o = self.options
        self.config = AutoConfig.from_pretrained(o.model)
        dtype = getattr(torch, o.dtype) if o.dtype else (getattr(self.config, "dtype", None) or torch.float32)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        self.dtype = dtype
        if any(os.path.exists(os.path.join(o.model, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
            self.tokenizer = AutoTokenizer.from_pretrained(o.model)
        started = time.perf_counter()
        self.weights.connect(RequestedLockType.RW_OR_RO, _timeout_ms(o.lock_timeout_s))
        if self.weights.granted_lock_type is GrantedLockType.RW:
            log.info("rank %d: first on this GPU: loading %s into gms", o.rank, o.model)
            gms.torch.load_safetensors(self.weights, o.model, prefix=PREFIX)
            self.weights.commit()
            self.weights.connect(RequestedLockType.RO, _timeout_ms(o.lock_timeout_s))
            self.weights.remap_all_vas()  # back on our own addresses, as a reader
            self.loaded_from_disk = True
        self.device = gms.torch.views.device_for(self.weights.backend, o.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._materialize()
        self.timings["weights_s"] = time.perf_counter() - started
        self._warm_up()
        if o.mode == "primary":
            self._make_kv_cache()
            self.phase = "serving"
        else:
            gms.torch.sleep(self.weights)  # shadow: weights imported, nothing mapped, no KV
            self.phase = "asleep"
        log.info("rank %d: %s (weights %s in %.2f s)", o.rank, self.phase,
                 "loaded" if self.loaded_from_disk else "imported", self.timings["weights_s"])

    def _materialize(self) -> None:
        with gms.torch.empty_parameters():
            model = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype)
        gms.torch.materialize_module(model, self.weights, prefix=PREFIX)
        self.model = model.eval()

    def _warm_up(self) -> None:
        """One token through the model and a static KV cache of the serving shape
        (plain torch memory, dropped after), so the first real request (a
        shadow's first, right after a failover) loads no kernels: CUDA loads
        each lazily, and the cached attention path uses others than a
        forward without a cache."""
        started = time.perf_counter()
        cache = StaticCache(config=self.config, max_cache_len=self.options.max_seq_len)
        with torch.inference_mode():
            self.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device), past_key_values=cache,
                       cache_position=torch.arange(1, device=self.device), use_cache=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.timings["warm_up_s"] = time.perf_counter() - started

    def _make_kv_cache(self) -> None:
        o = self.options
        self.kv_mgr.connect(RequestedLockType.RW, _timeout_ms(o.lock_timeout_s))
        shape = KvShape.of(self.config, o.max_seq_len, self.dtype)
        self.kv = GmsKvCache(self.kv_mgr, self.config, shape, self.device, o.kv_bytes, o.kv_chunk_bytes)

    # -- sleep and wake -----------------------------------------------------

    def sleep(self) -> float:
        if self.phase == "asleep":
            return 0.0
        self._expect("serving")
        started = time.perf_counter()
        self.phase = "sleeping"
        if self.kv is not None:
            gms.torch.sleep(self.kv_mgr)  # the KV layout is dropped with the lock
        gms.torch.sleep(self.weights)
        self.phase = "asleep"
        return time.perf_counter() - started

    def revoke_kv(self) -> int:
        """Take the KV layout's lock from whoever holds it on this GPU's server (a
        hung primary): the failover step a coordinator off the node cannot do.
        Needs admin rights on the server (its uid, root, or a policy admin)."""
        from gms.client.admin import revoke

        return revoke(self.options.gms_socket, "kv_cache", missing_ok=True)  # none left: nothing held

    def wake(self) -> dict[str, float]:
        if self.phase == "serving":
            return {}
        self._expect("asleep")
        timeout = _timeout_ms(self.options.lock_timeout_s)
        self.phase = "waking"
        t0 = time.perf_counter()
        try:
            try:
                gms.torch.wake_weights(self.weights, timeout)
            except StaleMemoryLayoutError:  # another checkpoint was published: import it
                log.warning("rank %d: weights were republished; importing again", self.options.rank)
                self.weights.close()  # its preserved mappings belong to the old layout
                self.weights = GMSClientMemoryManager(self.options.gms_socket, device=self.options.device, layout="weights")
                self.weights.connect(RequestedLockType.RO, timeout)
                self._materialize()
            t1 = time.perf_counter()
            if self.kv is None:
                self._make_kv_cache()  # a shadow's first wake
            else:
                gms.torch.wake_kv_cache(self.kv_mgr, "kv_cache", timeout)
                self.kv.zero()
            t2 = time.perf_counter()
        except BaseException:
            self._back_to_sleep()
            raise
        self.phase = "serving"
        self.gms_notes = {}
        return {"weights_s": t1 - t0, "kv_s": t2 - t1}

    # -- the gms connections (a server restart) --------------------------------

    def check_gms(self, timeout_s: float) -> dict[str, str]:
        """Serving: take back a gms lock the server's restart broke, within
        ``timeout_s`` each.  Returns the notes: ``rode through`` (the weights,
        the same layout), ``rebuilt`` (the KV cache, fresh memory at its
        addresses), ``reconnecting: ...`` (no server yet: serving from the
        memory mapped, tried again next time), ``stale: ...`` (the weights'
        layout is gone or replaced: served as mapped, imported again at the
        next wake), ``revoked: ...`` (an admin took the lock: not healthy)."""
        if self.phase == "serving":
            self._check_weights(timeout_s)
            if self.kv is not None:
                self._check_kv(timeout_s)
        return dict(self.gms_notes)

    def _check_weights(self, timeout_s: float) -> None:
        note = self.gms_notes.get("weights", "")
        if self.weights.is_connected or note.startswith(("stale", "revoked")):
            return
        try:
            if self.weights.ensure_connected(timeout_s):
                self.gms_notes["weights"] = "rode through"
                log.warning("rank %d: the weights rode through a gms server restart", self.options.rank)
        except StaleMemoryLayoutError as exc:
            self.gms_notes["weights"] = f"stale: {exc}"
            log.warning("rank %d: weights stale after a gms restart (%s): serving as mapped",
                        self.options.rank, exc)
        except SessionEndedError as exc:
            self.gms_notes["weights"] = f"revoked: {exc}"
        except GMSError as exc:
            self.gms_notes["weights"] = f"reconnecting: {exc}"

    def _check_kv(self, timeout_s: float) -> None:
        note = self.gms_notes.get("kv_cache", "")
        if self.kv_mgr.is_connected or note.startswith("revoked"):
            return
        try:
            self.kv_mgr.ensure_connected(timeout_s)
            return  # nothing was lost
        except BuildLostError:
            pass  # the build went with its server: make it again
        except SessionEndedError as exc:
            self.gms_notes["kv_cache"] = f"revoked: {exc}"
            return
        except GMSUsageError:
            pass  # lost before, not rebuilt yet
        try:
            gms.torch.rebuild_kv_cache(self.kv_mgr, "kv_cache", int(timeout_s * 1000))
        except GMSError as exc:
            self.gms_notes["kv_cache"] = f"reconnecting: {exc}"  # the old memory is still mapped
            return
        self.kv.zero()
        self.gms_notes["kv_cache"] = "rebuilt"
        log.warning("rank %d: KV cache rebuilt after a gms server restart", self.options.rank)

    def weights_current(self, timeout_s: float) -> str | None:
        """Asleep: is the layout these weights wake on still committed on the
        server?  None if so (or if the server cannot be asked now: a wake
        would tell); otherwise why not (the next wake imports again)."""
        mine = self.weights.get_memory_layout_hash()
        try:
            row = get_runtime_state(self.options.gms_socket, timeout=timeout_s).layout("weights")
        except GMSError:
            return None
        if row.memory_layout_hash != mine:
            return f"the weights' layout on gms is {row.memory_layout_hash[:12] or 'gone'}, not {mine[:12]}"
        return None

    def _back_to_sleep(self) -> None:
        """A failed wake leaves nothing mapped and no lock held."""
        for mgr in (self.kv_mgr, self.weights):
            try:
                if mgr.is_connected and any(mp.mapped for mp in mgr.mappings):
                    mgr.unmap_all_vas()
            finally:
                mgr.abort()
        self.phase = "asleep"

    def _expect(self, phase: str) -> None:
        if self.phase != phase:
            raise EngineError(f"engine is {self.phase}, not {phase}")

    # -- serving ------------------------------------------------------------

    def tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise BadRequest("this model has no tokenizer: send the prompt as token ids")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.config.get_text_config(decoder=True).vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise BadRequest(f"token ids must be in [0, {vocab})")
            return prompt
        raise BadRequest("prompt must be a string or a list of token ids")

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def generate(self, prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> tuple[list[int], str]:
        """Greedy decoding over the static KV cache; returns (tokens, finish_reason)."""
        self._expect("serving")
        if not prompt:
            raise BadRequest("the prompt is empty")
        if max_tokens < 1:
            raise BadRequest("max_tokens must be at least 1")
        limit = self.options.max_seq_len
        if len(prompt) + max_tokens > limit:
            raise BadRequest(f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the {limit} tokens "
                             "this engine's KV cache holds (--max-seq-len)")
        eos = set() if ignore_eos else _eos_ids(self.config)
        cache = self.kv.cache
        self.kv.reset()
        out: list[int] = []
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=self.device)
            positions = torch.arange(len(prompt), device=self.device)
            while True:
                self._maybe_stall()
                logits = self.model(input_ids=ids, past_key_values=cache, cache_position=positions,
                                    use_cache=True).logits
                self.steps += 1
                token = int(logits[0, -1].argmax())
                out.append(token)
                if token in eos:
                    return out, "stop"
                if len(out) == max_tokens:
                    return out, "length"
                ids = torch.tensor([[token]], device=self.device)
                positions = positions[-1:] + 1

    def _maybe_stall(self) -> None:
        while self.options.stall_file and os.path.exists(self.options.stall_file):
            time.sleep(0.05)

    def canary(self) -> float:
        """One token through the whole model; returns its seconds."""
        started = time.perf_counter()
        self.generate([0], 1, ignore_eos=True)
        return time.perf_counter() - started

    def weights_held(self) -> bool:
        """Asleep and healthy: the weights' address space is still reserved."""
        return bool(self.weights.mappings) and not any(mp.mapped for mp in self.weights.mappings)

    def state(self) -> dict:
        o = self.options
        params = [p for _, p in self.model.named_parameters()] if self.model is not None else []
        return {
            "phase": self.phase, "mode": o.mode, "rank": o.rank, "world_size": o.world_size,
            "pid": os.getpid(), "device": str(getattr(self, "device", "")),
            "loaded_from_disk": self.loaded_from_disk,
            "weights_addresses": [p.data_ptr() for p in params[:4]],
            "weights_reserved": [mp.va for mp in self.weights.mappings],
            "kv_addresses": self.kv.addresses() if self.kv is not None else [],
            "kv_bytes": self.kv.total_bytes if self.kv is not None else 0,
            "max_seq_len": o.max_seq_len,
            "timings": self.timings,
        }

    def close(self) -> None:
        for mgr in (self.kv_mgr, self.weights):
            mgr.close()


def _eos_ids(config) -> set[int]:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, list | tuple) else {eos}
