"""Pure judgement of probes: when does a run of failed canaries make a failure."""

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
