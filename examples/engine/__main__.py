"""A small serving engine whose weights and KV cache live in gms.

    python examples/engine --model DIR [--gms-socket PATH] [--port 8000] [--rank R --world-size W --device N]
                           [--max-seq-len 512] [--kv-bytes 2GiB]
    GMS_MODE=shadow python examples/engine ...     # import weights, then sleep with no KV cache

The HTTP server listens at once (``/health`` says ``starting``) while the
weights are loaded or imported in a worker thread; the engine then serves
(``GMS_MODE=primary``, the default) or sleeps (``GMS_MODE=shadow``).  A line
of JSON on stdout says when it is ready.  SIGTERM or SIGINT stops it.
See docs/failover.md.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

import trio

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # also when run as a file elsewhere
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything comes from --model and gms: never the hub

from engine_http import build_app  # noqa: E402
from engine_model import Engine  # noqa: E402
from engine_options import parse  # noqa: E402
from hypercorn.config import Config  # noqa: E402
from hypercorn.trio import serve  # noqa: E402

log = logging.getLogger("engine")


async def main_async(engine: Engine) -> int:
    o = engine.options
    config = Config()
    config.bind = [f"{o.host}:{o.port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    config.graceful_timeout = 1.0
    status = 0
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(serve, build_app(engine), config)

            async def stop_on_signal() -> None:
                async for signum in signals:
                    log.info("%s: stopping", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    return

            nursery.start_soon(stop_on_signal)
            try:
                # abandon_on_cancel: a signal during a long load stops the process now
                await trio.to_thread.run_sync(engine.start, abandon_on_cancel=True)
            except Exception:
                log.exception("rank %d: start failed", o.rank)
                status = 1
                nursery.cancel_scope.cancel()
                return status
            print(json.dumps({"event": "ready", "phase": engine.phase, "rank": o.rank, "pid": os.getpid(),
                              "binds": binds, **engine.timings}), flush=True)
    return status


def main() -> int:
    logging.basicConfig(level=os.environ.get("ENGINE_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    engine = Engine(parse())
    try:
        return trio.run(main_async, engine)
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
