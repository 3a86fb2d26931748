"""A client in its own process, for tests: ``python tests/proc_client.py CMD SOCKET DEVICE [ARG]``.

read KEY     map the tensor KEY describes, print ``<va> <hex bytes>``, wait for stdin, exit
write-ro KEY map KEY read-only and try to write it (must die)
touch-unmapped KEY  map KEY, unmap_all_vas, then read it (must die)
hold-rw      take RW, build a layout, print ready, wait to be killed
"""

import sys

from gms import GMSClientMemoryManager


def mapped(mgr, key):
    allocation_id, offset, value = mgr.metadata_get(key)
    va = mgr.create_mapping(allocation_id)
    return va + offset, int(value)


def main() -> None:
    cmd, socket_path, device, *rest = sys.argv[1:]
    mgr = GMSClientMemoryManager(socket_path, device=int(device))
    if cmd == "hold-rw":
        mgr.connect("RW")
        for n in range(3):
            va = mgr.create_mapping(size=(n + 1) << 20, tag="weights")
            mgr.write(va, b"x" * 64)
        print("ready", flush=True)
        sys.stdin.readline()
        return
    mgr.connect("RO")
    va, size = mapped(mgr, rest[0])
    if cmd == "read":
        print(va, mgr.read(va, size).hex(), flush=True)
        sys.stdin.readline()
    elif cmd == "write-ro":
        print("writing", flush=True)
        mgr.write(va, b"overwrite")
    elif cmd == "touch-unmapped":
        mgr.unmap_all_vas()
        print("reading", flush=True)
        mgr.read(va, size)
    print("survived", flush=True)


if __name__ == "__main__":
    main()
