"""The KV cache: fixed tensors in gms's ``kv_cache`` layout, under a transformers StaticCache.

The layout is held RW and never committed: it lives exactly as long as the
engine's session (a crash or a revoke releases it).  Per layer, keys and
values are ``[1, kv_heads, max_seq_len, head_dim]`` views of packed gms
allocations; ``kv_bytes`` beyond what they need is allocated too, in chunks,
standing for the block pool a paged engine would size to the GPU (it is what
makes a large KV cache wait for memory at failover).

Sleep unmaps it and drops the lock (``gms.torch.sleep``); wake takes the lock
again and maps fresh memory at the same addresses (``gms.torch.wake_kv_cache``),
so the very tensors the StaticCache holds are valid again: only their
contents are new, and are zeroed (fresh memory may hold NaN patterns that a
masked attention would still multiply by zero).
"""

from __future__ import annotations

import math

import attrs
import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

import gms.torch
from gms import GMSClientMemoryManager
from gms.torch.encoding import TensorMeta
from gms.torch.views import Region

TAG = "kv_cache"


@attrs.frozen
class KvShape:
    layers: int
    kv_heads: int
    head_dim: int
    max_seq_len: int
    dtype: torch.dtype

    @classmethod
    def of(cls, config, max_seq_len: int, dtype: torch.dtype) -> KvShape:
        text = config.get_text_config(decoder=True)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        return cls(text.num_hidden_layers, kv_heads, head_dim, max_seq_len, dtype)

    @property
    def tensor_meta(self) -> TensorMeta:
        shape = (1, self.kv_heads, self.max_seq_len, self.head_dim)
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        return TensorMeta(self.dtype, shape, stride)

    @property
    def tensor_bytes(self) -> int:
        return self.tensor_meta.extent_bytes

    @property
    def static_bytes(self) -> int:
        """Keys and values of every layer."""
        return 2 * self.layers * self.tensor_bytes


class GmsKvCache:
    """A StaticCache whose tensors are gms memory; ``mgr`` must hold RW on ``kv_cache``."""

    def __init__(self, mgr: GMSClientMemoryManager, config, shape: KvShape, device: torch.device,
                 kv_bytes: int | None = None, chunk_bytes: int = 1 << 30) -> None:
        if kv_bytes is not None and kv_bytes < shape.static_bytes:
            raise ValueError(
                f"--kv-bytes {kv_bytes} is less than the {shape.static_bytes} bytes that "
                f"{shape.max_seq_len} tokens of KV cache need"
            )
        self.mgr, self.shape, self.device = mgr, shape, device
        self.cache = StaticCache(config=config, max_cache_len=shape.max_seq_len)
        for layer in self.cache.layers:
            if type(layer) is not StaticLayer:
                raise ValueError(f"only full-attention layers are supported, not {type(layer).__name__}")
        sizes = [shape.tensor_bytes] * (2 * shape.layers)
        plan = gms.torch.plan_packs(sizes, chunk_bytes)
        vas = [mgr.create_mapping(size=size, tag=TAG) for size in plan.pack_sizes]
        sizes_of = {mp.va: mp.size for mp in mgr.mappings}
        regions = [Region(va, sizes_of[va], device) for va in vas]
        views = [regions[p.pack].tensor(p.offset, shape.tensor_meta) for p in plan.placements]
        self.extra_bytes = 0
        if kv_bytes is not None:
            rest = kv_bytes - sum(sizes_of[va] for va in vas)
            while rest > 0:  # the pool beyond the static cache, in chunks
                va = mgr.create_mapping(size=min(rest, chunk_bytes), tag=TAG)
                size = next(mp.size for mp in mgr.mappings if mp.va == va)
                self.extra_bytes += size
                rest -= size
        self.keys, self.values = views[0::2], views[1::2]
        for layer, k, v in zip(self.cache.layers, self.keys, self.values):
            _bind(layer, k, v)
        self.zero()

    @property
    def total_bytes(self) -> int:
        return self.mgr.total_bytes

    def zero(self) -> None:
        for t in (*self.keys, *self.values):
            t.zero_()
        self.reset()

    def reset(self) -> None:
        """Forget the last sequence (its stale entries are masked out)."""
        for layer in self.cache.layers:
            layer.cumulative_length.zero_()

    def addresses(self) -> list[int]:
        return [t.data_ptr() for t in (*self.keys, *self.values)]


def _bind(layer: StaticLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Initialize a StaticLayer over our tensors instead of its own zeros.

    Its lazy initialization runs on ``meta`` tensors of the right shape (which
    allocates nothing) to set every attribute it needs; then the tensors and
    the device are ours.  tests/test_engine.py checks that generation keeps
    using these very addresses.
    """
    fake = torch.empty((1, keys.shape[1], 1, keys.shape[3]), dtype=keys.dtype, device="meta")
    layer.lazy_initialization(fake, fake)
    layer.keys, layer.values = keys, values
    layer.device = keys.device
    layer.cumulative_length = torch.zeros((), dtype=torch.long, device=keys.device)
