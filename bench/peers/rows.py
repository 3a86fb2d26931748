"""The rows both sides run, written once over each side's own client.

A side gives :func:`rows` a function that opens its client for a row
(``open_client(params, "RW" | "RO", fresh)``; ``fresh``: a writer that loads
a model, as Dynamo's loaders do, clears what the layout held) as a
:class:`Client`: the client's own
bound methods, so what is timed is the side's call and nothing of ours.  The
rows that differ by nature (the handshake, the raw handshake's bytes, the
import) stay in each side's file.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import NamedTuple

from harness import fd_count, frame, import_sizes, measure, raw_handshake, stats, throughput

MiB2 = 2 << 20
VALUE = b"v" * 64


class Client(NamedTuple):
    """One side's client, open with its lock: its own methods."""

    allocate: Callable  # (size, tag) -> (allocation id, ...)
    export: Callable  # allocation id -> fd
    metadata_put: Callable  # (key, allocation id, offset, value)
    metadata_get: Callable  # key -> (allocation id, offset, value)
    commit: Callable  # () -> None; raises if the side refused it
    close: Callable


def raw_handshake_row(p: dict, request: dict, answer_type: str) -> dict:
    """A handshake through a bare socket (no client library): the side's own request
    (msgpack, spelt once here only to make its bytes), checked once for its answer."""
    import msgpack

    op = raw_handshake(p["socket"], frame(msgpack.packb(request, use_bin_type=True)))
    answer = msgpack.unpackb(op())
    if answer.get("type") != answer_type or answer.get("success") is not True:
        raise RuntimeError(f"unexpected handshake answer {answer!r}")
    return stats(measure(op, p["n"], p["warmup"]))


def rows(open_client: Callable[..., Client]) -> dict[str, Callable[[dict], dict]]:
    """The rows of bench/peers/run.py that read and write the same way on both sides."""

    # -- setup: the committed layout the read rows use --------------------------------------

    def setup(p: dict) -> dict:
        c = open_client(p, "RW", fresh=True)
        ids = [c.allocate(MiB2, "weights")[0] for _ in range(4)]
        for i in range(100):  # one request each: Dynamo's client has no batch
            c.metadata_put(f"key.{i}", ids[i % 4], i, VALUE)
        c.commit()
        c.close()
        return {"ids": ids}

    # -- read rows ------------------------------------------------------------------------

    def export(p: dict) -> dict:
        c = open_client(p, "RO")
        allocation_id = p["ids"][0]
        result = stats(measure(lambda: os.close(c.export(allocation_id)), p["n"], p["warmup"]))
        c.close()
        return result

    def export_fds(p: dict) -> dict:
        """The server's fd table before and after ``n`` exports on one open session."""
        c = open_client(p, "RO")
        allocation_id, pid = p["ids"][0], p["server_pid"]
        before = fd_count(pid)
        for _ in range(p["n"]):
            os.close(c.export(allocation_id))
        after = fd_count(pid)
        c.close()
        time.sleep(0.2)
        return {"exports": p["n"], "before": before, "after": after, "added": after - before,
                "after_close": fd_count(pid)}

    def metadata_get(p: dict) -> dict:
        c = open_client(p, "RO")
        if c.metadata_get("key.42") != (p["ids"][42 % 4], 42, VALUE):
            raise RuntimeError("metadata_get answered something else")
        return stats(measure(lambda: c.metadata_get("key.42"), p["n"], p["warmup"]))

    def rpc_throughput(p: dict) -> dict:
        def make_op():
            c = open_client(p, "RO")
            return lambda: c.metadata_get("key.42")

        return throughput(make_op, p["processes"], p["duration"], first_cpu=3 if p.get("pin") else None)

    # -- write rows (each ends without a commit: the server drops what it made) ---------------

    def allocate(p: dict) -> dict:
        c = open_client(p, "RW")
        result = stats(measure(lambda: c.allocate(MiB2, "bench"), p["n"], p["warmup"]))
        c.close()
        return result

    def allocate_export(p: dict) -> dict:
        """gms's allocate exports at once; Dynamo's makes its fd at the first export."""
        c = open_client(p, "RW")

        def op() -> None:
            allocation_id = c.allocate(MiB2, "bench")[0]
            os.close(c.export(allocation_id))

        result = stats(measure(op, p["n"], p["warmup"]))
        c.close()
        return result

    def metadata_put(p: dict) -> dict:
        c = open_client(p, "RW")
        allocation_id = c.allocate(MiB2, "bench")[0]
        keys = iter(range(10**9))
        result = stats(measure(lambda: c.metadata_put(f"k.{next(keys)}", allocation_id, 0, VALUE),
                               p["n"], p["warmup"]))
        c.close()
        return result

    # -- the committed model a fresh process imports -------------------------------------------

    def import_build(p: dict) -> dict:
        c = open_client(p, "RW", fresh=True)
        sizes = import_sizes(p["check"])
        for size in sizes:
            c.allocate(size, "weights")
        c.commit()
        c.close()
        return {"allocations": len(sizes), "bytes": sum(sizes)}

    return {
        "setup": setup, "export": export, "export_fds": export_fds, "metadata_get": metadata_get,
        "throughput": rpc_throughput, "allocate": allocate, "allocate_export": allocate_export,
        "metadata_put": metadata_put, "import_build": import_build,
    }
