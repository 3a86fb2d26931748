"""Each side's framework floor: a bare server on the framework it is built on.

What a round trip costs before any service logic: a server that reads a
frame (4-byte length, body) and answers a fixed one, nothing else, on the
same socket type and framing both services use.  gms's side is Trio (its
server's own accept machinery, ``trio.serve_listeners``); Dynamo's is
asyncio with uvloop installed, as its server runs (plain asyncio where uvloop
is missing, and the row says so).  The rows time, from a fresh client
process through the raw-socket harness:

* connect, one frame each way, close (what a handshake costs at least);
* one frame each way on an open connection (what any request costs at least);
* the same from 8 client processes at once, closed loop (what the throughput
  row's requests cost at least, the framework's scheduling of many
  connections included).

    python bench/peers/floors.py serve trio|asyncio SOCKET     (run by bench/peers/run.py)
    python bench/peers/floors.py ROW PARAMS_JSON
"""

from __future__ import annotations

import os
import socket
import struct
import sys

from harness import child_main, frame, measure, raw_handshake, read_frame, stats, throughput

ANSWER = frame(b"\x81\xa4type\xb1HandshakeResponse")  # any small msgpack body
REQUEST = frame(b"\x81\xa4type\xb0HandshakeRequest")


# -- the servers ------------------------------------------------------------------------


def serve_trio(path: str) -> None:
    import trio

    async def handle(stream) -> None:
        buffer = b""
        while True:
            data = await stream.receive_some(65536)
            if not data:
                return
            buffer += data
            while len(buffer) >= 4 and len(buffer) >= (end := 4 + struct.unpack(">I", buffer[:4])[0]):
                buffer = buffer[end:]
                await stream.send_all(ANSWER)

    async def main() -> None:
        sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await sock.bind(path)
        sock.listen(1024)
        await trio.serve_listeners(handle, [trio.SocketListener(sock)])

    trio.run(main)


def serve_asyncio(path: str) -> None:
    import asyncio

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass

    async def handle(reader, writer) -> None:
        try:
            while True:
                (length,) = struct.unpack(">I", await reader.readexactly(4))
                await reader.readexactly(length)
                writer.write(ANSWER)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_unix_server(handle, path, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def loop_name(kind: str) -> str:
    if kind == "trio":
        return "Trio"
    try:
        import uvloop  # noqa: F401

        return "asyncio + uvloop"
    except ImportError:
        return "asyncio (uvloop missing)"


# -- the rows -----------------------------------------------------------------------------


def connect_row(p: dict) -> dict:
    return stats(measure(raw_handshake(p["socket"], REQUEST), p["n"], p["warmup"]))


def _round_trip(path: str):
    """An open connection's round trip (the socket lives as long as the op)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)

    def op() -> bytes:
        sock.sendall(REQUEST)
        return read_frame(sock)

    return op


def round_trip_row(p: dict) -> dict:
    return stats(measure(_round_trip(p["socket"]), p["n"], p["warmup"]))


def throughput_row(p: dict) -> dict:
    return throughput(lambda: _round_trip(p["socket"]), p["processes"], p["duration"],
                      first_cpu=3 if p.get("pin") else None)


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        os.environ.setdefault("PYTHONUNBUFFERED", "1")
        (serve_trio if sys.argv[2] == "trio" else serve_asyncio)(sys.argv[3])
    else:
        child_main({"floor_connect": connect_row, "floor_round_trip": round_trip_row,
                    "floor_throughput": throughput_row})
