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
