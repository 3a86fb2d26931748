"""Which model an engine serves, and the names of its gms layouts.

One gms server per GPU holds any number of layouts, so a node serves several
models: each model (and, under tensor or pipeline parallelism, each rank,
whose weights are a different shard) publishes its own weights layout, under
the engine's name::

    vllm/Llama-3.1-8B-Instruct/bfloat16/3f9a1c2b7d04              (TP 1)
    sglang/Llama-3.1-8B-Instruct/bfloat16/8e21f0c4a9d3/tp1of2     (rank 1 of TP 2)

The digest covers everything that decides the published tensors' names,
shapes and bytes: the engine and its version (each fuses and shards
parameters its own way, and that can change between releases), the model
(its absolute path, or its hub id), revision, dtype, architecture and the
parallel sizes.  The readable part is only for people reading ``gms status``.

An engine's scratch memory (the KV cache; SGLang's CUDA graphs) is RW and
never committed; each engine has its own, named by the process that holds it
(the kernel's pid), so engines that are awake together never wait for each
other's lock::

    vllm-kv/Llama-3.1-8B-Instruct/3f9a1c2b7d04/tp0of1/pid4242
    sglang-graph/Llama-3.1-8B-Instruct/8e21f0c4a9d3/tp0of1/pid4243

The identity is also published with the weights (``identity_key``), and a
reader compares it with its own before it maps anything.  Pure: no engine, no I/O.
"""

from __future__ import annotations

import hashlib
import json
import re

import attrs

from .errors import ConfigError

MAX_LAYOUT_BYTES = 128  # the server's limit (gms.fsm.sessions)
_LAYOUT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]*")  # the server's alphabet
_SLUG_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
SLUG_CHARS = 40
# The short names of the scratch layouts' tags, in their layout names.
SCRATCH_NAMES = {"kv_cache": "kv", "cuda_graph": "graph"}


def identity_key(engine: str) -> str:
    """The metadata key of the published identity."""
    return f"{engine}/identity.json"


def tensor_prefix(engine: str) -> str:
    """The metadata keys' prefix of every parameter and buffer, as gms.torch describes them."""
    return f"{engine}/tensors/"


@attrs.frozen
class ModelIdentity:
    """What decides the bytes an engine's worker would publish as its weights."""

    engine: str  # "vllm", "sglang": the layout names' first part
    engine_version: str
    model: str  # absolute path of a local model, or a hub id
    revision: str | None
    dtype: str  # torch's name without "torch.": "bfloat16"
    architecture: str
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __attrs_post_init__(self) -> None:
        if not (0 <= self.tp_rank < self.tp_size and 0 <= self.pp_rank < self.pp_size):
            raise ValueError(f"rank outside its group: tp {self.tp_rank}/{self.tp_size}, "
                             f"pp {self.pp_rank}/{self.pp_size}")

    @property
    def digest(self) -> str:
        """Of the whole model, not of one rank: every rank of a model shares it."""
        fields = [self.engine, self.engine_version, self.model, self.revision or "", self.dtype,
                  self.architecture, str(self.tp_size), str(self.pp_size)]
        return hashlib.sha256("\0".join(fields).encode()).hexdigest()[:12]

    @property
    def slug(self) -> str:
        name = self.model.rstrip("/").rsplit("/", 1)[-1]
        return (_SLUG_UNSAFE.sub("-", name).strip("-.") or "model")[:SLUG_CHARS]

    @property
    def rank_suffix(self) -> str:
        """``/tp1of2`` (and ``/pp0of2``) under parallelism; empty for a single rank."""
        suffix = f"/tp{self.tp_rank}of{self.tp_size}" if self.tp_size > 1 or self.pp_size > 1 else ""
        return suffix + (f"/pp{self.pp_rank}of{self.pp_size}" if self.pp_size > 1 else "")

    def to_json(self) -> bytes:
        return json.dumps(attrs.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> ModelIdentity:
        return cls(**json.loads(raw))

    def differences(self, other: ModelIdentity) -> list[str]:
        """Fields in which ``other`` (say, what a layout was published for) differs."""
        return [f"{f.name}: {getattr(other, f.name)!r}, this engine {getattr(self, f.name)!r}"
                for f in attrs.fields(ModelIdentity) if getattr(self, f.name) != getattr(other, f.name)]


def check_layout_name(name: str, what: str = "layout") -> str:
    if len(name.encode()) > MAX_LAYOUT_BYTES or not _LAYOUT.fullmatch(name):
        raise ConfigError(
            f"{what} name {name!r}: at most {MAX_LAYOUT_BYTES} bytes, starting with a letter or digit, "
            "then letters, digits and . _ : @ + / -"
        )
    return name


def weights_layout(identity: ModelIdentity, override: str | None = None) -> str:
    if override is not None:
        return check_layout_name(override + identity.rank_suffix, "gms_layout")
    base = f"{identity.engine}/{identity.slug}/{identity.dtype}/{identity.digest}"
    return check_layout_name(base + identity.rank_suffix)


def scratch_layout(identity: ModelIdentity, tag: str, pid: int, override: str | None = None) -> str:
    """The layout of one of an engine's scratch tags (``kv_cache``, ``cuda_graph``)."""
    if override is not None:
        return check_layout_name(override + identity.rank_suffix, f"the {tag} layout")
    ranks = f"tp{identity.tp_rank}of{identity.tp_size}"
    if identity.pp_size > 1:
        ranks += f"/pp{identity.pp_rank}of{identity.pp_size}"
    kind = SCRATCH_NAMES.get(tag, tag)
    return check_layout_name(f"{identity.engine}-{kind}/{identity.slug}/{identity.digest}/{ranks}/pid{pid}")
