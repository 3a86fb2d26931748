"""A Llama-shaped bf16 safetensors checkpoint of a chosen size, written fast.

Shapes come from Llama-3.2-3B's config (hidden 3072, intermediate 8192, 24
heads of 128, 8 KV heads, vocabulary 128256): embeddings and head of 751 MiB,
then as many 9-tensor, 192 MiB decoder layers as the size asks for, so 8 GiB
is about 310 tensors.  Below 4 GiB the vocabulary is Llama-2's 32000, so the
embeddings do not outgrow the model.  Bytes are random (one random block repeated), written
straight to the file without building tensors in memory.
"""

from __future__ import annotations

import json
import os
import struct

HIDDEN, INTER, KV = 3072, 8192, 1024
GiB = 1 << 30


def layer_shapes(i: int) -> list[tuple[str, tuple[int, ...]]]:
    p = f"model.layers.{i}."
    return [
        (p + "input_layernorm.weight", (HIDDEN,)),
        (p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
        (p + "self_attn.k_proj.weight", (KV, HIDDEN)),
        (p + "self_attn.v_proj.weight", (KV, HIDDEN)),
        (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
        (p + "post_attention_layernorm.weight", (HIDDEN,)),
        (p + "mlp.gate_proj.weight", (INTER, HIDDEN)),
        (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
        (p + "mlp.down_proj.weight", (HIDDEN, INTER)),
    ]


def nbytes(shape) -> int:
    n = 2
    for d in shape:
        n *= d
    return n


def llama_shapes(total_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Embedding, layers up to ``total_bytes``, final norm and lm_head."""
    vocab = 128256 if total_bytes >= 4 * GiB else 32000
    ends = [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (vocab, HIDDEN))]
    shapes = [("model.embed_tokens.weight", (vocab, HIDDEN))]
    used = sum(nbytes(s) for _, s in shapes + ends)
    i = 0
    while True:
        layer = layer_shapes(i)
        size = sum(nbytes(s) for _, s in layer)
        if used + size > total_bytes and i > 0:
            break
        shapes += layer
        used += size
        i += 1
    return shapes + ends


def write_safetensors(path: str, shapes) -> None:
    """``shapes`` ((name, shape), ...) as a bf16 safetensors file: random bytes
    (one block repeated), written straight to the file, fsynced."""
    header, offset = {}, 0
    for name, shape in shapes:
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes(shape)]}
        offset += nbytes(shape)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    block = os.urandom(64 << 20)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        left = offset
        while left:
            n = min(left, len(block))
            f.write(block[:n])
            left -= n
        f.flush()
        os.fsync(f.fileno())


def write_checkpoint(path: str, total_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    shapes = llama_shapes(total_bytes)
    write_safetensors(path, shapes)
    return shapes


def evict(path: str) -> bool:
    """Drop the file from the page cache (fadvise works for any owner; as root
    also drop every clean page); True if the second worked too."""
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def warm(path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(64 << 20)
        while f.readinto(buffer):
            pass
