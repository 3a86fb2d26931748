"""The coordinator: one serving set, one shadow set, and failover between them.

It holds the serving lock on behalf of the serving set and probes both sets:
the serving set's canary must answer ``serving`` on every rank, the shadow's
``asleep``.  When a rank of the serving set dies, or its canary fails
``failures`` times in a row (an error, or no answer in ``canary_timeout_s``),
or it reports work pending and no model step done for ``stall_s`` (an
engine that reports its progress: ``health.py``):

1. **revoke** the ``kv_cache`` layout on every rank's gms server, so the
   failed engines' KV sessions are dropped even if they hang (SIGSTOP);
2. **release** the serving lock;
3. **take** it for the shadow set and **wake** every rank in parallel
   (``POST /wake_up``, or the engine's own: ``wake_path``), then check a
   **first token** on every rank.  The
   failed set is killed meanwhile: a hung engine's mappings keep its memory
   alive (revoke frees the lock, not another process's mappings), and a
   large KV cache needs that memory back;
4. **restart** the failed set in lockstep as the new shadow (``GMS_MODE=shadow``).

Every decision is logged with a timestamp; every event is also a JSON line
(on stdout, and in ``events`` if configured); the failover's line carries the
seconds of each phase: detect, revoke, lock, wake, first token.

A restart of a rank's gms server is no failover: the engines keep serving
from the memory they mapped and their canary takes their locks back (a
``gms`` event line says what each rank reports: rode through, rebuilt,
reconnecting, stale).  What a restart can break shows as failed canaries
and is handled as any other: a shadow whose weights' layout is gone fails
its canary and is restarted (it loads the weights again), a serving engine
whose lock was revoked fails its canary and is failed over.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from functools import partial

import attrs
import httpx
import trio

from ..client import admin
from . import probes
from .config import CoordinatorConfig, KubernetesSetConfig
from .health import Pace, Watch, gms_reports, observe, pace
from .lock import FileServingLock, ServingLock
from .sets import EngineSet, KubernetesPodSet, LocalProcessSet

log = logging.getLogger("gms.failover")
KV_LAYOUT = "kv_cache"
START_ATTEMPTS = 3  # tries for a set at the coordinator's own start (a restart tries until the set is up)


class LostServingLock(RuntimeError):
    """Someone else holds the serving lock: this coordinator must not act."""


def make_lock(spec: str) -> ServingLock:
    """``file:PATH`` (one node) or ``lease:NAMESPACE/NAME`` (a Kubernetes Lease)."""
    kind, _, where = spec.partition(":")
    if kind == "file" and where:
        return FileServingLock(where)
    if kind == "lease" and "/" in where:
        from .lease import LeaseServingLock  # gms/failover/lease.py (the Kubernetes lock)

        namespace, name = where.split("/", 1)
        return LeaseServingLock(namespace=namespace, name=name)
    raise ValueError(f"lock {spec!r}: expected file:PATH or lease:NAMESPACE/NAME")


class Events:
    """JSON lines, one per event, on stdout and optionally in a file."""

    def __init__(self, path: str | None) -> None:
        self._file = open(path, "a", buffering=1) if path else None

    def emit(self, event: str, **fields) -> dict:
        record = {"event": event, "t": time.time(), **fields}
        line = json.dumps(record)
        print(line, flush=True)
        if self._file:
            self._file.write(line + "\n")
        return record

    def close(self) -> None:
        if self._file:
            self._file.close()


@attrs.define
class Failover:
    """Times (monotonic) of one failover's steps."""

    failed: str
    serving: str
    reason: str
    first_bad: float
    decided: float
    marks: dict[str, float] = attrs.Factory(dict)

    def phases(self) -> dict[str, float]:
        m, out, last = self.marks, {"detect_s": self.decided - self.first_bad}, self.decided
        for name in ("revoke", "lock", "wake", "first_token"):
            if name in m:
                out[f"{name}_s"] = m[name] - last
                last = m[name]
        out["total_s"] = last - self.decided
        return out


class Coordinator:
    def __init__(self, config: CoordinatorConfig, lock: ServingLock, client: httpx.AsyncClient,
                 nursery: trio.Nursery, events: Events) -> None:
        self.config = config
        self.lock = lock
        self.client = client
        self.nursery = nursery
        self.events = events
        self.sets: dict[str, EngineSet] = {s.name: self._make_set(s) for s in config.sets}
        self.serving, self.standby = config.initial, self._other(config.initial)
        self.watch = {name: Watch() for name in self.sets}
        self.restarting: dict[str, trio.Event] = {}
        self.exited: dict[str, float] = {}  # set -> when one of its processes was seen exiting
        self._wakeup = trio.Event()
        self._probing: trio.CancelScope | None = None  # the monitor's round of probes, while in flight
        self.failovers = 0
        self._gms_notes: dict[str, dict] = {}  # url -> what its engine last said of gms
        self._pace: dict[str, Pace] = {}  # url -> its steps, and since when they stood with work pending

    def _make_set(self, s) -> EngineSet:
        if isinstance(s, KubernetesSetConfig):
            return KubernetesPodSet(s)
        return LocalProcessSet(s, self.config.ranks, self.nursery, self._on_exit)

    def _other(self, name: str) -> str:
        return next(n for n in self.sets if n != name)

    def _on_exit(self, name: str, rank: int, code: int) -> None:
        self.exited.setdefault(name, time.monotonic())
        self._wakeup.set()  # look now, not at the next tick
        if self._probing is not None:
            self._probing.cancel()  # nor after the canaries in flight answer

    # -- the whole life ---------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._take_lock_at_start()
            self.events.emit("start", serving=self.serving, standby=self.standby, lock=self.config.lock,
                             ranks=list(self.config.ranks))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._bring_up, self.serving, "serving")
                nursery.start_soon(self._bring_up, self.standby, "standby")
            await self._monitor()
        finally:
            with trio.CancelScope(shield=True):
                for engine_set in self.sets.values():
                    await engine_set.stop()
                self.lock.release(self.serving)

    async def _take_lock_at_start(self) -> None:
        holder = self.lock.holder()
        if holder in self.sets:  # a Lease outlives a coordinator: adopt its holder
            self.serving, self.standby = holder, self._other(holder)
            log.info("the serving lock names set %s: it serves", holder)
        waited = False
        while not self.lock.try_acquire(self.serving):
            if not waited:
                log.warning("serving lock held by %s (another coordinator?); waiting", self.lock.holder())
                waited = True
            await trio.sleep(self.config.interval_s)
        log.info("took the serving lock for set %s", self.serving)

    async def _bring_up(self, name: str, role: str) -> None:
        """Start a set and wait until every rank is serving (role serving) or asleep."""
        started = time.monotonic()
        attempts = await self._start_until_ready(name, role, START_ATTEMPTS)
        self.events.emit("ready", set=name, role=role, seconds=time.monotonic() - started, attempts=attempts)

    async def _start_until_ready(self, name: str, role: str, attempts: int | None) -> int:
        """Start a set, all ranks together, until it is ready in ``role``: a set whose
        ranks exit or stall while starting (two vLLM engines starting side by side can
        draw the same free port for their rendezvous) is killed and started again,
        ``attempts`` times in all (None: until it is).  Returns the attempts made."""
        attempt = 0
        while True:
            attempt += 1
            try:
                await self.sets[name].start("primary" if role == "serving" else "shadow")
                await self._until_ready(name, role)
                return attempt
            except (RuntimeError, trio.TooSlowError) as exc:
                if attempts is not None and attempt >= attempts:
                    raise
                log.error("set %s: start attempt %d failed: %s", name, attempt, exc)
                await self.sets[name].kill()
                await trio.sleep(min(2.0 * attempt, 30.0))

    async def _until_ready(self, name: str, role: str) -> None:
        want = "serving" if role == "serving" else "asleep"
        engine_set = self.sets[name]
        with trio.fail_after(self.config.ready_timeout_s):
            while True:
                await engine_set.refresh()
                if engine_set.dead():
                    raise RuntimeError(f"set {name}: ranks {engine_set.dead()} exited while starting")
                round_ = await self._probe(name, want)
                if all(p.ok for p in round_):
                    return
                for url, p in zip(engine_set.urls(), round_):
                    # Pods always start as shadows; and an engine may come up in the wrong role.
                    if p.status == "asleep" and want == "serving":
                        log.info("set %s: waking %s", name, url)
                        await probes.post(self.client, url, self.config.wake_path, self.config.wake_timeout_s, {})
                    elif p.status == "serving" and want == "asleep":
                        log.info("set %s: putting %s to sleep", name, url)
                        await probes.post(self.client, url, self.config.sleep_path, self.config.canary_timeout_s, {})
                await trio.sleep(min(self.config.interval_s, 0.2))

    async def _probe(self, name: str, want: str):
        urls = self.sets[name].urls()
        results: list = [None] * len(urls)

        async def one(i: int, url: str) -> None:
            results[i] = await probes.health(self.client, url, want, self.config.canary_timeout_s,
                                             self.config.health_path)

        async with trio.open_nursery() as nursery:
            for i, url in enumerate(urls):
                nursery.start_soon(one, i, url)
        self._note_gms(name, results)
        return results

    def _note_gms(self, name: str, round_) -> None:
        """An event line whenever a rank's word on its gms connections changes."""
        self._gms_notes, news = gms_reports(self._gms_notes, round_)
        for p in news:
            log.warning("set %s: %s reports its gms connections: %s", name, p.url, p.gms)
            self.events.emit("gms", set=name, url=p.url, gms=p.gms)

    # -- watching ---------------------------------------------------------------

    async def _monitor(self) -> None:
        while True:
            if not self.lock.try_acquire(self.serving):  # renews a Lease
                raise LostServingLock(f"the serving lock is held by {self.lock.holder()!r}")
            failure = None
            with trio.CancelScope() as self._probing:  # an exit cancels it: it is looked at at once
                failure = await self._check_serving()
                if failure is None and self.standby not in self.restarting:
                    await self._check_standby()
            self._probing = None
            if failure is not None:
                await self._failover(*failure)
                continue
            with trio.move_on_after(self.config.interval_s):
                await self._wakeup.wait()
            self._wakeup = trio.Event()

    async def _check_serving(self) -> tuple[str, float] | None:
        name = self.serving
        engine_set = self.sets[name]
        await engine_set.refresh()
        dead = engine_set.dead()
        if dead:
            return f"ranks {dead} of set {name} exited", self.exited.pop(name, time.monotonic())
        round_ = await self._probe(name, "serving")
        self._pace, stalled = pace(self._pace, round_, time.monotonic(), self.config.stall_s)
        if stalled:
            self.watch[name] = Watch()
            p, since = stalled[0]
            return (f"{p.url} of set {name} made no progress for {time.monotonic() - since:.1f} s with "
                    f"{p.progress.pending} requests pending (steps {p.progress.steps})", since)
        self.watch[name], failed = observe(self.watch[name], round_, self.config.failures)
        bad = [p for p in round_ if not p.ok]
        if bad:
            log.warning("set %s: canary failed (%d in a row): %s", name, self.watch[name].streak,
                        "; ".join(f"{p.url}: {p.detail}" for p in bad))
        if failed:
            first_bad = self.watch[name].first_bad
            self.watch[name] = Watch()
            return f"canary failed {self.config.failures} times in a row on set {name}", first_bad
        return None

    async def _check_standby(self) -> None:
        name = self.standby
        engine_set = self.sets[name]
        await engine_set.refresh()
        dead = engine_set.dead()
        failed = bool(dead)
        if not dead:
            round_ = await self._probe(name, "asleep")
            self.watch[name], failed = observe(self.watch[name], round_, self.config.failures)
        if failed:
            self.watch[name] = Watch()
            self.exited.pop(name, None)
            log.warning("standby set %s failed (%s): restarting it", name,
                        f"ranks {dead} exited" if dead else "canary")
            self.events.emit("standby_failed", set=name, dead=dead)
            self._start_restart(name)

    # -- failing over -----------------------------------------------------------

    async def _failover(self, reason: str, first_bad: float) -> None:
        failed, new = self.serving, self.standby
        f = Failover(failed, new, reason, first_bad, time.monotonic())
        decided_at = time.time()
        log.warning("FAILOVER %s -> %s: %s", failed, new, reason)
        if new in self.restarting:
            log.warning("set %s is still restarting: waiting for it before failing over", new)
            await self.restarting[new].wait()
            f.decided = time.monotonic()
        # 1. revoke: the failed engines' KV sessions go, even if those engines hang
        # (with revoke = "engines", each new engine does it on its node as it wakes)
        revoked = await self._revoke_all() if self.config.revoke == "server" else {}
        f.marks["revoke"] = time.monotonic()
        # 2. release the lock, 3. take it for the shadow set
        self.lock.release(failed)
        while not self.lock.try_acquire(new):
            log.warning("serving lock not free for %s yet (held by %s)", new, self.lock.holder())
            await trio.sleep(0.05)
        f.marks["lock"] = time.monotonic()
        self.serving, self.standby = new, failed
        log.info("serving lock: set %s", new)
        # The failed set goes down now, while the shadow wakes (its memory may be needed).
        killed = trio.Event()
        self.restarting[failed] = trio.Event()
        self.nursery.start_soon(self._kill, failed, killed)
        # A JSON object always: SGLang's endpoints need one ({}: every memory tag).
        wake_body = {"revoke_kv": True} if self.config.revoke == "engines" else {}
        wake = await self._post_all(new, self.config.wake_path, self.config.wake_timeout_s, wake_body)
        if self.config.revoke == "engines":
            revoked = {f"rank {i}": body.get("revoked") if isinstance(body, dict) else body
                       for i, (_, body, _) in enumerate(wake)}
        f.marks["wake"] = time.monotonic()
        tokens = await self._first_tokens(new)
        f.marks["first_token"] = time.monotonic()
        ok = all(code == 200 for code, _, _ in wake + tokens)
        self.failovers += 1
        self.watch[new] = Watch()
        self._pace = {}  # the sets swapped roles: no rank's pace carries over
        self.events.emit(
            "failover", ok=ok, failed=failed, serving=new, reason=reason, decided_at=decided_at,
            revoked=revoked, wake=[_brief(r) for r in wake], first_token=[_brief(r) for r in tokens],
            **f.phases(),
        )
        log.info("set %s serves (%s); restarting set %s as the shadow", new, "ok" if ok else "NOT OK", failed)
        self.nursery.start_soon(self._restart, failed, killed)

    async def _revoke_all(self) -> dict[str, object]:
        out: dict[str, object] = {}

        async def one(socket: str) -> None:
            try:
                # Bounded: a hung server must not hold the failover up.
                out[socket] = await trio.to_thread.run_sync(
                    partial(admin.revoke, socket, KV_LAYOUT, timeout=self.config.canary_timeout_s, missing_ok=True)
                )
            except Exception as exc:  # noqa: BLE001 - a dead server must not stop the failover
                out[socket] = f"error: {exc}"

        async with trio.open_nursery() as nursery:
            for socket in self.config.ranks:
                nursery.start_soon(one, socket)
        log.info("revoked %s: %s", KV_LAYOUT, out)
        return out

    async def _post_all(self, name: str, path: str, timeout: float, body: dict | None = None) -> list:
        urls = self.sets[name].urls()
        results: list = [None] * len(urls)

        async def one(i: int, url: str) -> None:
            results[i] = await probes.post(self.client, url, path, timeout, body)

        async with trio.open_nursery() as nursery:
            for i, url in enumerate(urls):
                nursery.start_soon(one, i, url)
        return results

    async def _first_tokens(self, name: str) -> list:
        urls = self.sets[name].urls()
        results: list = [None] * len(urls)

        async def one(i: int, url: str) -> None:
            results[i] = await probes.first_token(self.client, url, self.config.wake_timeout_s)

        async with trio.open_nursery() as nursery:
            for i, url in enumerate(urls):
                nursery.start_soon(one, i, url)
        return results

    # -- restarting -------------------------------------------------------------

    def _start_restart(self, name: str) -> None:
        if name in self.restarting:
            return
        self.restarting[name] = trio.Event()
        killed = trio.Event()
        self.nursery.start_soon(self._kill, name, killed)
        self.nursery.start_soon(self._restart, name, killed)

    async def _kill(self, name: str, done: trio.Event) -> None:
        started = time.monotonic()
        await self.sets[name].kill()
        log.info("set %s killed (%.3f s)", name, time.monotonic() - started)
        done.set()

    async def _restart(self, name: str, killed: trio.Event) -> None:
        """Bring a set back as the shadow, all ranks together; retry until it is."""
        started = time.monotonic()
        await killed.wait()
        attempt = await self._start_until_ready(name, "standby", None)
        self.exited.pop(name, None)
        self.watch[name] = Watch()
        self.events.emit("restarted", set=name, role="standby", seconds=time.monotonic() - started,
                         attempts=attempt)
        self.restarting.pop(name).set()
        self._wakeup.set()


def _brief(result) -> dict:
    """An HTTP result for the event line: the engine's own timings if it gave any, else the error."""
    code, body, seconds = result
    if code != 200:
        return {"code": code, "seconds": seconds, "error": body}
    timings = {k: v for k, v in body.items() if k.endswith("_s")} if isinstance(body, dict) else {}
    return {"code": code, "seconds": seconds, **({"engine": timings} if timings else {})}


async def run(config: CoordinatorConfig, *, lock: ServingLock | None = None) -> None:
    """Run until cancelled (a signal) or the serving lock is lost."""
    import signal

    events = Events(config.events)
    lock = lock or make_lock(config.lock)
    try:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with httpx.AsyncClient() as client, trio.open_nursery() as nursery:
                coordinator = Coordinator(config, lock, client, nursery, events)

                async def on_signal() -> None:
                    async for signum in signals:
                        log.info("%s: stopping", signal.Signals(signum).name)
                        nursery.cancel_scope.cancel()
                        return

                async def main() -> None:
                    await coordinator.run()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(on_signal)
                nursery.start_soon(main)
    finally:
        events.close()
        sys.stdout.flush()
