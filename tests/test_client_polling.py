"""The client's choice to poll for an answer or block (gms/client/transport.py).

A blocked answer's time includes the wake-up, so it must not decide whether
the next call polls: counted, it kept a request kind that had once been slow
out of polling for good (metadata puts on the 2-core host: 136 µs, 55 µs
since; bench/peers/run.py --backend host).
"""

from __future__ import annotations

import types

import pytest

from gms.client import transport
from gms.client.transport import PROBE_EVERY, RpcTransport
from gms.errors import GMSError
from gms.wire import messages as m

WINDOW_S = 200e-6


@pytest.fixture
def fresh_kind():
    """A request kind with no history, and the history restored afterwards."""
    kind = m.MetadataGetRequest
    saved = {name: dict(getattr(transport, name)) for name in ("_recent", "_median", "_unpolled")}
    for name in saved:
        getattr(transport, name).pop(kind, None)
    yield kind
    for name, table in saved.items():
        getattr(transport, name).clear()
        getattr(transport, name).update(table)


def _slow(kind: type) -> None:
    transport._median[kind] = 10.0  # once slow: answers took ten seconds


def test_a_kind_seen_slow_polls_only_every_probe_th_call(fresh_kind):
    _slow(fresh_kind)
    polled = [transport._polls(fresh_kind, WINDOW_S) for _ in range(3 * PROBE_EVERY)]
    assert [i for i, p in enumerate(polled) if p] == [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1, 3 * PROBE_EVERY - 1]


def test_a_few_slow_answers_do_not_stop_polling(fresh_kind, monkeypatch):
    now = 100.0  # the transport's clock stands still: the answers' times are exactly these
    monkeypatch.setattr(transport, "time", types.SimpleNamespace(perf_counter=lambda: now))
    for took in [50e-6] * 6 + [5e-3] * 3:  # three outliers in nine
        transport._observe(fresh_kind, now - took)
    assert transport._polls(fresh_kind, WINDOW_S)


def test_a_kind_that_became_quick_polls_again_after_one_probe(server, fresh_kind):
    """Over a real socket: answers blocked for are not counted, the probe's is.
    (A window of a second: any host answers a get well within half of it.)"""
    window_s = 1.0
    rpc = RpcTransport(server.socket, spin_us=window_s * 1e6)
    try:
        _slow(fresh_kind)
        for _ in range(PROBE_EVERY):  # no session: each is answered NOT_CONNECTED, an answer all the same
            with pytest.raises(GMSError):
                rpc.call(m.MetadataGetRequest("nothing"), m.MetadataGetResponse)
        # Only the probe's answer was counted.
        assert len(transport._recent[fresh_kind]) == 1
        assert transport._polls(fresh_kind, window_s)
    finally:
        rpc.close()


@pytest.mark.parametrize(("cpus", "window_us"), [(2, 200.0), (4, 200.0), (16, 1000.0)])
def test_the_window_is_short_where_the_client_shares_few_cpus(monkeypatch, cpus, window_us):
    monkeypatch.setattr(transport.os, "sched_getaffinity", lambda pid: set(range(cpus)))
    assert transport._default_spin_us() == window_us
