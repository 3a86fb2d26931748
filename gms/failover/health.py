"""Pure judgement of probes: when does a run of failed canaries make a failure,
and when has an engine stopped making progress.

An engine that says what it is doing (``"progress": {"steps": S, "pending": P}``
in its health answer: model steps done so far, requests admitted and not
finished) is judged by that, not by how fast its canary comes back: a
saturated engine answers late but its steps go on; a hung one (an engine core
stopped, a kernel that never returns) answers at once, with work pending and
its steps frozen.  ``stall_s`` of frozen steps with work pending is a failure
at once (the window is the debounce); an engine that says nothing of its
progress is judged by its canaries alone, as before."""

from __future__ import annotations

import attrs


@attrs.frozen
class Probe:
    """One rank's canary: GET /health answered 200 with the status we wanted."""

    url: str
    ok: bool
    status: str | None  # the engine's own word: serving, asleep, starting, ...
    detail: str
    started: float  # monotonic
    seconds: float
    # What the engine says of its gms connections, if anything happened to them
    # (a server restart: "rode through", "rebuilt", "reconnecting: ...", "stale: ...").
    gms: dict = attrs.Factory(dict)
    progress: Progress | None = None  # None: the engine does not say


@attrs.frozen
class Progress:
    steps: int  # model steps (forward passes) done since the engine started
    pending: int  # requests admitted and not finished (a canary included)

    @classmethod
    def parse(cls, body: object) -> Progress | None:
        """From a health answer's ``progress``; None where absent or malformed."""
        if not isinstance(body, dict):
            return None
        steps, pending = body.get("steps"), body.get("pending")
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in (steps, pending)):
            return None
        return cls(steps, pending)


@attrs.frozen
class Pace:
    """A rank's last steps count, and since when they have not moved while work was pending."""

    steps: int
    since: float  # monotonic


@attrs.frozen
class Watch:
    """Failed probes in a row, and when the first of them started."""

    streak: int = 0
    first_bad: float | None = None


def observe(watch: Watch, probes: list[Probe], failures: int) -> tuple[Watch, bool]:
    """Fold one round of probes (every rank of a set) in; True when the set has failed.

    A set is healthy only when every rank is: one bad rank is a bad round.
    """
    if all(p.ok for p in probes):
        return Watch(), False
    started = min(p.started for p in probes if not p.ok)
    watch = Watch(watch.streak + 1, watch.first_bad if watch.first_bad is not None else started)
    return watch, watch.streak >= failures


def pace(seen: dict[str, Pace], probes: list[Probe], now: float,
         stall_s: float) -> tuple[dict[str, Pace], list[tuple[Probe, float]]]:
    """Fold in each rank's progress: the new record (by URL), and the ranks
    stalled (with since when): work pending and no step done for ``stall_s``."""
    seen = dict(seen)
    stalled = []
    for p in probes:
        if p.progress is None:
            seen.pop(p.url, None)
            continue
        last = seen.get(p.url)
        if p.progress.pending == 0 or last is None or p.progress.steps != last.steps:
            seen[p.url] = Pace(p.progress.steps, now)
        elif now - last.since >= stall_s:
            stalled.append((p, last.since))
    return seen, stalled


def gms_reports(seen: dict[str, dict], probes: list[Probe]) -> tuple[dict[str, dict], list[Probe]]:
    """Fold in what each rank says of its gms connections: the new record (by
    URL), and the probes whose word changed to something worth an event line."""
    seen = dict(seen)
    news = []
    for p in probes:
        if p.gms != seen.get(p.url, {}):
            seen[p.url] = p.gms
            if p.gms:
                news.append(p)
    return seen, news
