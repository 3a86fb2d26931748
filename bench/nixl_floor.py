"""The floor a peer tier is measured against (issue 65): NIXL moving host memory between two processes.

    python3 bench/nixl_floor.py [--size 256MiB] [--repeats 5] [--tls auto|tcp]

Needs NIXL (``pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1 numpy``; not a
dependency of gms yet, nor installed by CI).  Two processes on this host, as two
gms nodes would be: a *holder* with the bytes in memfd memory (as the host tier
keeps its chunks) and a *puller* that reads them into memfd memory of its own with
one NIXL ``READ``, its UCX backend named (``instantiate_all`` wants cloud
configuration), no progress thread (it would busy-poll one of two cores: the
holder calls NIXL in a loop to make progress instead).  The agents' metadata and
descriptors go over a socketpair.  Each repeat is timed from the request to its
state DONE; the puller's pages are faulted in first, so the repeats measure the
link, not the kernel zeroing pages; the last repeat's bytes are checked (crc32)
against the holder's.  In the same run, the memory floor: one ``memmove`` of the
same bytes between two buffers of one process.  ``--tls tcp`` sets
``UCX_TLS=tcp,self`` (loopback TCP); ``--tls netns`` (root) puts the two in two
network namespaces joined by a veth pair, which UCX treats as two nodes: the
nearest one host gets to a link between two machines.
Writes ``nixl_floor_<tls>.json`` under ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import socket
import struct
import subprocess
import sys
import time
import zlib

import msgpack
from _common import add_out, cpu_name, log, print_table, versions, write_results

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gms.units import parse_bytes

BLOCK = 1 << 20


def memfd_buffer(size: int, fill: bool) -> tuple[mmap.mmap, int]:
    """``size`` bytes of memfd memory, mapped, every page touched (random blocks, or zeros)."""
    fd = os.memfd_create("gms-nixl-floor")
    try:
        os.ftruncate(fd, size)
        buf = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    block = os.urandom(BLOCK) if fill else bytes(BLOCK)
    for offset in range(0, size, BLOCK):
        buf[offset : offset + BLOCK] = block[: size - offset]
    return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf))


def agent(name: str):
    from nixl._api import nixl_agent, nixl_agent_config

    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def send(sock: socket.socket, obj) -> None:
    body = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(struct.pack("!Q", len(body)) + body)


def recv(sock: socket.socket):
    def exactly(n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError("the other process went away")
            out += chunk
        return bytes(out)

    (length,) = struct.unpack("!Q", exactly(8))
    return msgpack.unpackb(exactly(length), raw=False)


def holder(sock: socket.socket, size: int) -> None:
    """The bytes' side: register them, say where they are, make progress until told to stop."""
    buf, addr = memfd_buffer(size, fill=True)
    me = agent("holder")
    me.register_memory([(addr, size, 0, "")], "DRAM")
    descs = me.get_xfer_descs([(addr, size, 0)], "DRAM")
    send(sock, [me.get_agent_metadata(), me.get_serialized_descs(descs), zlib.crc32(buf)])
    sock.setblocking(False)
    while True:
        me.get_new_notifs()  # (no progress thread: this is what moves a transfer on this side)
        try:
            sock.recv(1)  # a byte, or the end: the puller is done
            return
        except BlockingIOError:
            time.sleep(0.0002)


def puller(sock: socket.socket, size: int, repeats: int) -> dict:
    buf, addr = memfd_buffer(size, fill=False)
    me = agent("puller")
    me.register_memory([(addr, size, 0, "")], "DRAM")
    metadata, serialized, crc = recv(sock)
    peer = me.add_remote_agent(metadata)
    remote = me.deserialize_descs(serialized)
    local = me.get_xfer_descs([(addr, size, 0)], "DRAM")
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        handle = me.initialize_xfer("READ", local, remote, peer, b"")
        state = me.transfer(handle)
        while state == "PROC":
            state = me.check_xfer_state(handle)
        seconds.append(time.perf_counter() - started)
        handle.release()
        if state != "DONE":
            raise RuntimeError(f"the NIXL transfer ended {state}")
    equal = zlib.crc32(buf) == crc
    sock.send(b"x")
    return {"seconds": seconds, "equal": equal}


def memory_floor(size: int, repeats: int) -> list[float]:
    """One memmove of ``size`` bytes between two faulted-in buffers of this process, ``repeats`` times."""
    _src, src_addr = memfd_buffer(size, fill=True)  # (held: the addresses are theirs)
    _dst, dst_addr = memfd_buffer(size, fill=False)
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        ctypes.memmove(dst_addr, src_addr, size)
        out.append(time.perf_counter() - started)
    return out


NETNS = ("gms-floor-a", "gms-floor-b")
VETH = ("gms-floor-va", "gms-floor-vb")
ADDRS = ("10.211.0.1", "10.211.0.2")
PORT = 47311


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


def two_namespaces() -> None:
    """Two network namespaces joined by a veth pair (UCX counts that as two nodes); root only."""
    for ns in NETNS:
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, veth, addr in zip(NETNS, VETH, ADDRS):
        sh("ip", "link", "set", veth, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
        sh("ip", "-n", ns, "link", "set", veth, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")


def no_namespaces() -> None:
    for ns in NETNS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)  # (gone already: fine)


def across_namespaces(args) -> dict:
    """The holder in one namespace, the puller in the other (``ip netns exec`` gives each the
    sysfs of its own namespace, where UCX finds its veth), metadata over TCP between them."""
    no_namespaces()
    two_namespaces()
    try:
        me = [sys.executable, os.path.abspath(__file__), "--size", str(args.size), "--repeats", str(args.repeats)]
        env = {**os.environ, "UCX_TLS": "tcp,self"}
        holder_proc = subprocess.Popen(["ip", "netns", "exec", NETNS[0], *me, "--role", "holder"],
                                       env={**env, "UCX_NET_DEVICES": VETH[0]})
        try:
            out = subprocess.run(["ip", "netns", "exec", NETNS[1], *me, "--role", "puller"],
                                 env={**env, "UCX_NET_DEVICES": VETH[1]}, capture_output=True, text=True, timeout=600,
                                 check=False)
            if out.returncode:
                raise RuntimeError(f"the puller failed: {out.stderr[-2000:]}")
            return json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            holder_proc.wait(timeout=60)
    finally:
        no_namespaces()


def role(args) -> int:
    """One side of a run across namespaces."""
    if args.role == "holder":
        with socket.create_server((ADDRS[0], PORT)) as server:
            conn, _ = server.accept()
            with conn:
                holder(conn, args.size)
        return 0
    for _ in range(200):  # the holder's namespace may not listen yet
        try:
            conn = socket.create_connection((ADDRS[0], PORT), timeout=5)
            break
        except OSError:
            time.sleep(0.05)
    with conn:
        print(json.dumps(puller(conn, args.size, args.repeats)))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_out(p)
    p.add_argument("--size", default="256MiB", type=parse_bytes)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tls", choices=("auto", "tcp", "netns"), default="auto",
                   help="UCX's transports: auto, tcp (loopback TCP), netns (TCP over a veth between two namespaces)")
    p.add_argument("--role", choices=("holder", "puller"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role:
        return role(args)
    if args.tls == "tcp":
        os.environ["UCX_TLS"] = "tcp,self"
    if args.tls == "netns":
        pulled = across_namespaces(args)
    else:
        ours, theirs = socket.socketpair()
        pid = os.fork()
        if pid == 0:
            ours.close()
            try:
                holder(theirs, args.size)
            finally:
                os._exit(0)
        theirs.close()
        try:
            pulled = puller(ours, args.size, args.repeats)
        finally:
            os.waitpid(pid, 0)
    floor = memory_floor(args.size, args.repeats)
    gb = args.size / 1e9
    results = {
        "cpu": cpu_name(), "cores": os.cpu_count(), "versions": versions("nixl", "nixl-cu13"), "tls": args.tls,
        "size_bytes": args.size, "repeats": args.repeats, "equal": pulled["equal"],
        "nixl_read_s": pulled["seconds"], "memmove_s": floor,
        "nixl_gb_per_s_best": gb / min(pulled["seconds"]), "memmove_gb_per_s_best": gb / min(floor),
    }
    log(f"{args.size >> 20} MiB, UCX {args.tls}: bytes equal {pulled['equal']}")
    print_table(f"NIXL between two processes, {cpu_name()}, {os.cpu_count()} cores", [
        ("NIXL READ, holder -> puller", f"{min(pulled['seconds']):.3f}", f"{results['nixl_gb_per_s_best']:.2f}"),
        ("memmove in one process (the memory floor)", f"{min(floor):.3f}", f"{results['memmove_gb_per_s_best']:.2f}"),
    ], header=("best of the repeats", "s", "GB/s"))
    write_results(args.out, f"nixl_floor_{args.tls}", results)
    return 0 if pulled["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
