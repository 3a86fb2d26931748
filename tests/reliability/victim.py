"""A real client process for the crash tests: it runs its flow to one step,
says so on stdout (one JSON line), then waits to be SIGKILLed.

    python victim.py SOCKET LAYOUT LOCK STEP SEED [BIG_BYTES]

LOCK is RW, RO or RW_OR_RO; STEP one of :data:`STEPS`.  A writer fills its
allocations with :func:`pattern` (seeded by SEED) and describes each with a
metadata entry whose value names the seed, so any reader can check the bytes
byte for byte without being told what was written.  The pattern helpers are
imported by the tests too (this module has no side effects on import).
"""

from __future__ import annotations

import json
import random
import sys

MiB = 1 << 20
SIZES = (3 * MiB, 1 * MiB)  # aligned to 4 and 2 MiB on the host backend

STEPS = (
    "connected",  # socket open, no handshake
    "handshaken",  # lock granted, nothing done
    "mid-allocate",  # an allocation the server is waiting to make room for (OOM wait)
    "exported-fds",  # holding exported fds, nothing mapped
    "metadata-put",  # a writer's layout built and described, not committed
    "host-copy-fill",  # a writer filling server-made host copies (residency system)
    "commit-partial",  # half of the CommitRequest frame sent
    "commit-sent",  # the whole CommitRequest sent, answer not read
    "committed-mapped",  # committed, reconnected RO and remapped its own memory
    "reader-mapped",  # a reader with the committed layout mapped and checked
    "restoring",  # the reader restoring an evicted layout, half copied
    "waiting",  # queued for the lock
)


def pattern(seed: str, index: int, size: int) -> bytes:
    return random.Random(f"{seed}/{index}").randbytes(size)


def describe(seed: str, index: int, size: int) -> bytes:
    return f"{seed}|{index}|{size}".encode()


def build(mgr, seed: str, sizes=SIZES, *, mapped: bool = True, metadata: bool = True) -> list[str]:
    """Allocate, fill with the pattern and describe; returns the allocation ids."""
    ids = []
    for index, size in enumerate(sizes):
        allocation_id, _ = mgr.allocate_handle(size, tag="weights")
        ids.append(allocation_id)
        if mapped:
            va = mgr.create_mapping(allocation_id)
            mgr.write(va, pattern(seed, index, size))
        if metadata:
            mgr.metadata_put(f"t{index}", allocation_id, 0, describe(seed, index, size))
    return ids


def verify(mgr) -> int:
    """Map every described allocation and check its bytes; returns how many.
    Raises AssertionError on the first byte that differs."""
    checked = 0
    for key, allocation_id, offset, value in mgr_scan(mgr):
        seed, index, size = value.decode().rsplit("|", 2)
        va = mgr.create_mapping(allocation_id)
        data = mgr.read(va + offset, int(size))
        expected = pattern(seed, int(index), int(size))
        if data != expected:
            first = next(i for i, (a, b) in enumerate(zip(data, expected)) if a != b)
            raise AssertionError(f"{key}: byte {first} of {size} differs")
        checked += 1
    return checked


def mgr_scan(mgr):
    from gms.wire import messages as m

    response, _ = mgr._link.call(m.MetadataScanRequest(""), m.MetadataScanResponse)
    return list(response.rows())


def say(**fields) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def hold() -> None:
    sys.stdin.read()  # until killed (or the test closes stdin)


def main() -> None:
    socket_path, layout, lock, step, seed, *rest = sys.argv[1:]
    big = int(rest[0]) if rest else 0
    if step == "connected":
        import socket

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(socket_path)
        say(ready=step)
        hold()
        return

    from gms import GMSClientMemoryManager
    from gms.wire import encode
    from gms.wire import messages as m

    mgr = GMSClientMemoryManager(socket_path, layout=layout)
    if step == "waiting":
        say(ready=step)
        mgr.connect(lock)
        say(unexpected=f"granted {mgr.granted_lock_type.value}")
        hold()
        return
    if step == "restoring":
        restore_half(socket_path, layout, lock)
        say(ready=step)
        hold()
        return

    mgr.connect(lock)
    granted = mgr.granted_lock_type.value
    if step == "handshaken":
        say(ready=step, granted=granted)
    elif granted == "RO":
        if step == "exported-fds":
            fds = [fd for _, fd in mgr.export_handles([h.allocation_id for h in mgr.list_handles()])]
            say(ready=step, granted=granted, fds=len(fds))
        elif step == "reader-mapped":
            say(ready=step, granted=granted, checked=verify(mgr))
        else:
            raise SystemExit(f"step {step} is not a reader's")
    elif step == "mid-allocate":
        build(mgr, seed, SIZES[:1])
        say(ready=step, granted=granted)
        mgr.allocate_handle(big, tag="weights")  # waits for memory until killed
        say(unexpected="allocated")
    elif step == "exported-fds":
        ids = build(mgr, seed, mapped=False, metadata=False)
        fds = [fd for _, fd in mgr.export_handles(ids)]
        say(ready=step, granted=granted, fds=len(fds))
    else:
        ids = build(mgr, seed)
        if step == "metadata-put":
            say(ready=step, granted=granted)
        elif step == "host-copy-fill":
            fill_half(mgr, ids)
            say(ready=step, granted=granted)
        elif step in ("commit-partial", "commit-sent"):
            mgr.unmap_all_vas()
            frame = encode(m.CommitRequest())
            sock = mgr._res.transport._sock
            sock.sendall(frame if step == "commit-sent" else frame[: len(frame) // 2])
            say(ready=step, granted=granted)
        elif step == "committed-mapped":
            mgr.commit()
            mgr.connect("RO")
            mgr.remap_all_vas()
            say(ready=step, granted=granted, checked=verify(mgr))
        else:
            raise SystemExit(f"unknown step {step}")
    hold()


def fill_half(mgr, ids: list[str]) -> None:
    """The writer's side of residency system, stopped halfway: the server has
    made the host copies, half of the first is filled."""
    from gms.wire import messages as m

    response, fds = mgr._link.call(m.ExportHostCopiesRequest(ids), m.ExportHostCopiesResponse)
    mapper = mgr._mapper
    live = {mp.allocation_id: mp.va for mp in mgr.mappings}
    info = response.allocations[0]
    dst = mapper.reserve(info.aligned_size)
    mapper.map_host(fds[0], dst, info.aligned_size)
    mapper.copy(dst, live[info.allocation_id], info.size // 2)
    # the other fds stay open in this process: held until the kill


def restore_half(socket_path: str, layout: str, lock: str) -> None:
    """The restorer's side of an evicted layout, stopped halfway."""
    from gms.client.transport import RpcTransport
    from gms.cuda import open_mapper
    from gms.wire import messages as m

    transport = RpcTransport(socket_path)
    response, _ = transport.call(m.HandshakeRequest(lock, None, layout), m.HandshakeResponse)
    if not response.restore:
        raise SystemExit("expected to be asked to restore")
    mapper = open_mapper(response.backend, 0)
    listing, _ = transport.call(m.ListAllocationsRequest(None), m.ListAllocationsResponse)
    ids = [a.allocation_id for a in listing.allocations]
    gpu, gpu_fds = transport.call(m.ExportAllocationsRequest(ids), m.ExportAllocationsResponse)
    host, host_fds = transport.call(m.ExportHostCopiesRequest(ids), m.ExportHostCopiesResponse)
    info = gpu.allocations[0]
    dst, src = mapper.reserve(info.aligned_size), mapper.reserve(info.aligned_size)
    mapper.map(gpu_fds[0], dst, info.aligned_size, True)
    mapper.map_host(host_fds[0], src, info.aligned_size)
    mapper.copy(dst, src, info.size // 2)
    globals()["_keep"] = (transport, mapper, gpu_fds, host_fds)  # held until the kill


if __name__ == "__main__":
    main()
