"""Prometheus metrics (``gms serve --metrics-port``), with ``prometheus-client``.

Gauges are read from the folded state when scraped: the state is an
immutable value, so the scraping thread reads a consistent snapshot without
a lock.  Counters and histograms are fed by the shell as events are appended
and requests are served.  Each server has its own registry.  A counter
labelled by layout loses its series when the layout goes (its counts went
with it), so layouts that come and go cannot grow the registry without end.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..fsm.events import Event, LayoutEvicted, RestoreFinished, RwCommit

log = logging.getLogger("gms.server")

_LAYOUT_TRANSITIONS = {RwCommit: "load", LayoutEvicted: "eviction", RestoreFinished: "restore"}
_LATENCY_BUCKETS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1, 3, 10, 30)


class _StateCollector:
    def __init__(self, core) -> None:
        self.core = core

    def collect(self):
        core = self.core
        state = core.state
        gauges = {
            "gms_capacity_bytes": ("Device memory in bytes", state.capacity_bytes),
            "gms_budget_bytes": (
                "Device memory budget in bytes (the capacity when no budget is set)",
                state.budget_bytes if state.budget_bytes is not None else state.capacity_bytes,
            ),
            "gms_device_used_bytes": ("Layout bytes in device memory (the GPU's; host memory on the host backend)",
                                      state.gpu_bytes),
            "gms_host_used_bytes": ("Layout bytes in the host tier", state.host_bytes),
            "gms_disk_used_bytes": ("Bytes of snapshots on the disk tier", state.disk_bytes),
            "gms_disk_loose_bytes": (
                "Bytes of files in the disk tier's folder no layout holds (set aside, left on disk): in its budget too",
                core.snapshots.store.loose_bytes if core.snapshots is not None else None,
            ),
            "gms_sessions": ("Handshaken connections", len(state.sessions)),
            "gms_events_logged": ("Last event sequence number", core.log.last_seq),
        }
        for name, (text, value) in gauges.items():
            if value is not None:
                yield GaugeMetricFamily(name, text, value=value)
        device = core.device
        server = GaugeMetricFamily(
            "gms_server_info", "What memory the device tier is (value 1): backend cuda or host",
            labels=["backend", "device", "uuid"],
        )
        server.add_metric([device.backend, str(device.device), device.uuid], 1)
        yield server
        if state.host_budget_bytes is not None:
            yield GaugeMetricFamily("gms_host_budget_bytes", "Host tier budget in bytes", value=state.host_budget_bytes)
        if state.disk_budget_bytes is not None:
            yield GaugeMetricFamily(
                "gms_disk_budget_bytes", "Disk tier budget in bytes (0: no disk tier)", value=state.disk_budget_bytes
            )
        layout_bytes = GaugeMetricFamily("gms_layout_bytes", "Bytes a layout holds, by tier", labels=["layout", "tier"])
        readers = GaugeMetricFamily("gms_layout_readers", "Readers of a layout", labels=["layout"])
        info = GaugeMetricFamily(
            "gms_layout_info", "A layout's lock state and residency (value 1)",
            labels=["layout", "state", "residency", "tier", "owner"],
        )
        waiting = GaugeMetricFamily("gms_lock_waiters", "Handshakes waiting for a lock", labels=["layout", "mode"])
        unsaved = GaugeMetricFamily(
            "gms_layout_unsaved", "1 for a commit that asked to persist and is not on disk yet; failing: its save "
            "failed at least once (gms status says why)", labels=["layout", "failing"],
        )
        for name, layout in state.layouts.items():
            if layout.unsaved:
                unsaved.add_metric([name, "yes" if layout.save_error else "no"], 1)
            layout_bytes.add_metric([name, "device"], layout.gpu_bytes)
            layout_bytes.add_metric([name, "host"], layout.host_bytes)
            layout_bytes.add_metric([name, "disk"], layout.disk_held)
            readers.add_metric([name], len(layout.readers))
            info.add_metric(
                [name, layout.lock_state.value, layout.residency.value, layout.tier.value, layout.owner or ""], 1
            )
        for name, (writers, others) in core.queues.snapshot().items():
            waiting.add_metric([name, "rw"], writers)
            waiting.add_metric([name, "other"], others)
        used = GaugeMetricFamily("gms_tenant_used_bytes", "Bytes a tenant keeps in gms", labels=["tenant"])
        quota = GaugeMetricFamily("gms_tenant_quota_bytes", "A tenant's quota in bytes", labels=["tenant"])
        sessions = GaugeMetricFamily("gms_tenant_sessions", "A tenant's handshaken connections", labels=["tenant"])
        over = GaugeMetricFamily(
            "gms_tenant_over_bound",
            "1 for each bound a tenant holds more than (a policy lowered it): it cannot grow until under it",
            labels=["tenant", "bound"],
        )
        disk = GaugeMetricFamily("gms_tenant_disk_bytes", "Bytes of a tenant's snapshots on disk", labels=["tenant"])
        for name, tenant in state.tenants.items():
            used.add_metric([name], tenant.used_bytes)
            disk.add_metric([name], tenant.disk_bytes)
            sessions.add_metric([name], tenant.sessions)
            if tenant.quota_bytes is not None:
                quota.add_metric([name], tenant.quota_bytes)
            for bound in tenant.over_bounds:
                over.add_metric([name, bound], 1)
        yield from (layout_bytes, readers, info, waiting, unsaved, used, quota, sessions, over, disk)
        keeper = core.keeper
        if keeper is not None:  # (a server without one has no keeper series)
            yield GaugeMetricFamily(
                "gms_keeper_attached", "1 while a keeper holds the node (a crash then loses nothing), else 0",
                value=1 if keeper.state in ("attached", "behind") else 0,
            )
            yield GaugeMetricFamily(
                "gms_keeper_backlog_bytes", "Bytes waiting for the keeper to read", value=keeper.backlog_bytes()
            )
            yield GaugeMetricFamily(
                "gms_keeper_behind_seconds", "How long the keeper has had bytes waiting", value=keeper.behind_s()
            )
            yield CounterMetricFamily("gms_keepers_lost", "Keepers that went away", value=keeper.lost)


class _EventCounts:
    """``gms_events_total`` by kind: a count per kind kept in a dict on the loop
    (every event passes here; a prometheus-client counter's ``inc`` takes a lock
    and checks its labels, several times the cost) and read by the scrape,
    which copies it in one step under the GIL."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def collect(self):
        family = CounterMetricFamily("gms_events", "Events appended, by kind", labels=["kind"])
        for kind, count in dict(self.counts).items():
            family.add_metric([kind], count)
        yield family


class Metrics:
    """Made before the core, whose every event it counts (``observe``, given to the
    core at construction); ``watch(core)`` then adds the gauges read from its state."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.events = _EventCounts()
        self.registry.register(self.events)
        self.layout_events = Counter(
            "gms_layout_transitions", "Loads (commits), evictions and restores, by layout",
            ["layout", "kind"], registry=self.registry,
        )
        self.allocate_seconds = Histogram(
            "gms_allocate_seconds", "Time to serve an allocation, waits for memory included",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.lock_wait_seconds = Histogram(
            "gms_lock_wait_seconds", "Time from handshake to grant", ["mode"],
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.refused = Counter(
            "gms_connections_refused", "Connections refused or closed before their first request, by reason",
            ["reason"], registry=self.registry,
        )
        self._server = None
        self._core = None
        self._labelled: dict[str, set[str]] = {}  # layout -> the kinds it has a series of
        self._by_kind: dict[str, object] = {}  # label children, looked up once each

    def lock_waited(self, mode: str, seconds: float) -> None:
        child = self._by_kind.get(mode)
        if child is None:
            child = self._by_kind[mode] = self.lock_wait_seconds.labels(mode)
        child.observe(seconds)

    def watch(self, core) -> None:
        self._core = core
        self.registry.register(_StateCollector(core))

    def observe(self, event: Event) -> None:
        """Called for each appended event, once its whole batch is folded."""
        counts = self.events.counts
        counts[event.KIND] = counts.get(event.KIND, 0) + 1
        kind = _LAYOUT_TRANSITIONS.get(type(event))
        if kind is not None:
            self.layout_events.labels(event.layout, kind).inc()
            self._labelled.setdefault(event.layout, set()).add(kind)
        if event.layout in self._labelled and self._core is not None and event.layout not in self._core.state.layouts:
            for kind in self._labelled.pop(event.layout):
                self.layout_events.remove(event.layout, kind)

    def refused_one(self, reason: str) -> None:
        self.refused.labels(reason).inc()

    def series(self) -> int:
        """Label series of the per-layout counter (for tests and bounds)."""
        return sum(len(kinds) for kinds in self._labelled.values())

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Serve /metrics from a thread; returns the port (useful with port 0)."""
        self._server, _ = start_http_server(port, host, registry=self.registry)
        bound = self._server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
