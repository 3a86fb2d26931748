"""The cluster serving lock: one Kubernetes Lease, held by the set that may serve.

Which replica set (primary or shadow) may wake and serve is whoever holds one
``coordination.k8s.io/v1`` Lease. The semantics are client-go's leader
election (``leaderelection`` with ``resourcelock.LeaseLock``):

* the spec holds ``holderIdentity``, ``leaseDurationSeconds``, ``acquireTime``,
  ``renewTime`` and ``leaseTransitions``;
* a Lease with an empty ``holderIdentity``, or whose ``renewTime +
  leaseDurationSeconds`` has passed, is free: anyone may take it, and
  ``leaseTransitions`` counts each change of holder;
* every write replaces the object we read, ``metadata.resourceVersion`` (and
  ``uid``) included: the API server refuses a stale one with 409 Conflict, so
  of two contenders that read the same Lease exactly one write lands. A 409
  means "someone else won": :meth:`LeaseServingLock.try_acquire` returns
  False and never raises for it;
* :meth:`~LeaseServingLock.release`, only by the holder, writes an empty
  ``holderIdentity`` and a one-second duration, as client-go does.

One difference from client-go: client-go judges expiry by the local time at
which *it observed* the record change, which is immune to clock skew but needs
a long-lived watcher. This lock is stateless between calls, so it compares the
Lease's ``renewTime`` with the local clock: the clocks of the machines that
use one Lease must agree to well within ``leaseDurationSeconds`` (NTP does).

A holder keeps the Lease by calling ``try_acquire`` again well inside the
duration (client-go renews every 2 s of a 15 s lease).

Real failures raise :class:`LeaseError` subclasses whose messages say what to
fix: the API unreachable, credentials refused (401), RBAC (403).
Needs the ``k8s`` extra: ``pip install 'gms[k8s]'``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path


import attrs

from ..errors import GMSError

try:
    import urllib3
    from kubernetes import client as k8s
    from kubernetes import config as k8s_config
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config.config_exception import ConfigException
except ImportError as exc:  # the k8s extra is optional; say how to get it
    raise ImportError(
        "gms.failover.lease needs the Kubernetes client: pip install 'gms[k8s]'"
    ) from exc

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
RELEASED_DURATION_S = 1  # client-go's release: expire at once for older clients too
_RELEASE_ATTEMPTS = 8


# -- errors --------------------------------------------------------------------


class LeaseError(GMSError):
    """The Lease could not be read or written (never: someone else holds it)."""


class LeaseConfigError(LeaseError):
    """No way to reach a cluster: no in-cluster service account and no usable kubeconfig."""


class LeaseAPIUnavailableError(LeaseError):
    """The API server could not be reached, timed out, or answered 429/5xx: try again later."""

    def __init__(self, text: str, *, status: int | None = None) -> None:
        super().__init__(text)
        self.status = status


class LeaseAPIError(LeaseError):
    """The API server refused the request; ``status``, ``reason`` and ``message`` are its Status."""

    def __init__(self, text: str, *, status: int, reason: str, message: str) -> None:
        super().__init__(text)
        self.status = status
        self.reason = reason
        self.message = message


class LeaseUnauthorizedError(LeaseAPIError):
    """401: the API server did not accept our credentials."""


class LeaseForbiddenError(LeaseAPIError):
    """403: our identity lacks an RBAC verb on leases.coordination.k8s.io."""


# -- the record ----------------------------------------------------------------


@attrs.frozen
class LeaseRecord:
    """What a Lease says, as read."""

    holder: str | None  # holderIdentity; None when empty or absent
    duration_s: int | None
    acquire_time: datetime | None
    renew_time: datetime | None
    transitions: int
    resource_version: str

    @property
    def expires_at(self) -> datetime | None:
        """``renewTime + leaseDurationSeconds`` (None: no time or no duration, so expired)."""
        start = self.renew_time or self.acquire_time
        if start is None or not self.duration_s:
            return None
        return start + timedelta(seconds=self.duration_s)

    def live_holder(self, now: datetime) -> str | None:
        expires = self.expires_at
        if not self.holder or expires is None or expires <= now:
            return None
        return self.holder


def _record(lease: k8s.V1Lease) -> LeaseRecord:
    spec = lease.spec or k8s.V1LeaseSpec()
    return LeaseRecord(
        holder=spec.holder_identity or None,
        duration_s=spec.lease_duration_seconds,
        acquire_time=_aware(spec.acquire_time),
        renew_time=_aware(spec.renew_time),
        transitions=spec.lease_transitions or 0,
        resource_version=lease.metadata.resource_version,
    )


def _now() -> datetime:
    return datetime.now(UTC)


def _aware(dt: datetime | None) -> datetime | None:
    if dt is None or dt.tzinfo is not None:
        return dt
    return dt.replace(tzinfo=UTC)  # the API's times are UTC


def _wire_time(dt: datetime | None) -> datetime | None:
    """A MicroTime the API server will parse.

    The client writes ``datetime.isoformat()``, which drops ``.000000`` on a
    whole second, and the server parses MicroTime with Go's RFC3339Micro
    layout, which demands exactly six fractional digits: such a body would be
    refused (400). A whole second is nudged by one microsecond instead.
    """
    dt = _aware(dt)
    if dt is None or dt.microsecond:
        return dt
    return dt.replace(microsecond=1)


def _check_holder(holder: str) -> None:
    if not isinstance(holder, str) or not holder:
        raise ValueError(f"a holder identity is a non-empty string, not {holder!r}")


# -- configuration -------------------------------------------------------------


def _in_cluster() -> bool:
    return bool(os.environ.get("KUBERNETES_SERVICE_HOST"))


def load_api_client(kubeconfig: str | None = None, context: str | None = None) -> k8s.ApiClient:
    """An ApiClient from the pod's service account (in a cluster, unless a
    kubeconfig is named) or from a kubeconfig (``$KUBECONFIG`` or
    ``~/.kube/config`` by default). Never touches the client's global config."""
    cfg = k8s.Configuration()
    try:
        if kubeconfig is None and _in_cluster():
            k8s_config.load_incluster_config(client_configuration=cfg)
        else:
            k8s_config.load_kube_config(
                config_file=kubeconfig, context=context, client_configuration=cfg, persist_config=False
            )
    except (ConfigException, OSError) as exc:
        where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise LeaseConfigError(
            f"cannot configure a Kubernetes client: {exc}. Run in a pod with a service account, "
            f"or give a kubeconfig (looked in {where})"
        ) from exc
    return k8s.ApiClient(cfg)


def default_namespace(kubeconfig: str | None = None, context: str | None = None) -> str:
    """``$POD_NAMESPACE``, else the service account's namespace in a pod, else
    the kubeconfig context's namespace, else ``default``."""
    if ns := os.environ.get("POD_NAMESPACE"):
        return ns
    if kubeconfig is None and _in_cluster():
        try:
            return Path(SERVICE_ACCOUNT_NAMESPACE).read_text().strip() or "default"
        except OSError:
            return "default"
    try:
        contexts, current = k8s_config.list_kube_config_contexts(kubeconfig)
        chosen = next(c for c in contexts if c["name"] == context) if context else current
        return (chosen.get("context") or {}).get("namespace") or "default"
    except (ConfigException, OSError, StopIteration, KeyError, TypeError, AttributeError):
        return "default"


# -- the lock ------------------------------------------------------------------


class LeaseServingLock:
    """:class:`ServingLock` on the Lease ``namespace/name``.

    ``api_client``: a configured ``kubernetes.client.ApiClient``; without one,
    the in-cluster service account or a kubeconfig (``kubeconfig``,
    ``context``) is used. ``namespace`` defaults as :func:`default_namespace`.
    ``duration_s`` is ``leaseDurationSeconds``: how long after its last renewal
    a holder keeps the Lease. Each API call times out after ``request_timeout_s``.
    """

    def __init__(
        self,
        name: str = "gms-serving",
        namespace: str | None = None,
        *,
        duration_s: int = 15,
        api_client: k8s.ApiClient | None = None,
        kubeconfig: str | None = None,
        context: str | None = None,
        request_timeout_s: float = 10.0,
    ) -> None:
        if isinstance(duration_s, bool) or not isinstance(duration_s, int) or duration_s < 1:
            raise ValueError(f"duration_s is a whole number of seconds >= 1, not {duration_s!r}")
        if api_client is None:
            api_client = load_api_client(kubeconfig, context)
        self.name = name
        self.namespace = namespace or default_namespace(kubeconfig, context)
        self.duration_s = duration_s
        self._api = k8s.CoordinationV1Api(api_client)
        self._timeout = request_timeout_s

    def __repr__(self) -> str:
        return f"LeaseServingLock({self.namespace}/{self.name}, {self.duration_s} s)"

    # -- the ServingLock protocol

    def try_acquire(self, holder: str) -> bool:
        _check_holder(holder)
        lease = self._read()
        now = _now()
        if lease is None:
            spec = k8s.V1LeaseSpec(
                holder_identity=holder,
                lease_duration_seconds=self.duration_s,
                acquire_time=now,
                renew_time=now,
                lease_transitions=0,
            )
            body = k8s.V1Lease(
                api_version="coordination.k8s.io/v1",
                kind="Lease",
                metadata=k8s.V1ObjectMeta(name=self.name, namespace=self.namespace),
                spec=spec,
            )
            return self._write("create", self._api.create_namespaced_lease, self.namespace, body)
        record = _record(lease)
        live = record.live_holder(now)
        if live is not None and live != holder:
            return False
        spec = lease.spec or k8s.V1LeaseSpec()
        if record.holder != holder:  # a change of holder: it was free, released or expired
            spec.acquire_time = now
            spec.lease_transitions = record.transitions + 1
        spec.holder_identity = holder
        spec.lease_duration_seconds = self.duration_s
        spec.renew_time = now
        lease.spec = spec
        return self._replace(lease)

    def release(self, holder: str) -> None:
        _check_holder(holder)
        for _ in range(_RELEASE_ATTEMPTS):
            lease = self._read()
            if lease is None or lease.spec is None or lease.spec.holder_identity != holder:
                return  # not ours (any more): nothing to release
            lease.spec.holder_identity = ""
            lease.spec.lease_duration_seconds = RELEASED_DURATION_S
            lease.spec.renew_time = _now()
            if self._replace(lease):
                return
            # 409: the holder renewed, or someone took over, between our read and write: look again
        raise LeaseError(f"{self}: releasing for {holder!r} kept conflicting with other writers")

    def holder(self) -> str | None:
        record = self.record()
        return None if record is None else record.live_holder(_now())

    # -- more

    def record(self) -> LeaseRecord | None:
        """The Lease as it is now (None when it does not exist)."""
        lease = self._read()
        return None if lease is None else _record(lease)

    def delete(self) -> bool:
        """Remove the Lease object (a teardown, an operator's reset), whoever holds it.
        True if there was one."""
        with self._translated("delete"):
            try:
                self._api.delete_namespaced_lease(
                    self.name, self.namespace, _request_timeout=self._timeout
                )
            except ApiException as exc:
                if exc.status == 404:
                    return False
                raise
        return True

    # -- API calls

    def _read(self) -> k8s.V1Lease | None:
        with self._translated("get"):
            try:
                return self._api.read_namespaced_lease(
                    self.name, self.namespace, _request_timeout=self._timeout
                )
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

    def _replace(self, lease: k8s.V1Lease) -> bool:
        return self._write(
            "update", self._api.replace_namespaced_lease, self.name, self.namespace, lease
        )

    def _write(self, verb: str, call: Callable, *args) -> bool:
        """True if the write landed; False on 409 (AlreadyExists on create,
        Conflict on a stale resourceVersion or uid): another writer won."""
        body = args[-1]
        body.spec.acquire_time = _wire_time(body.spec.acquire_time)
        body.spec.renew_time = _wire_time(body.spec.renew_time)
        with self._translated(verb):
            try:
                call(*args, _request_timeout=self._timeout)
            except ApiException as exc:
                if exc.status == 409:
                    return False
                raise
        return True

    @contextmanager
    def _translated(self, verb: str) -> Iterator[None]:
        """ApiException and transport failures become typed LeaseErrors."""
        host = self._api.api_client.configuration.host
        what = f"{verb} Lease {self.namespace}/{self.name} at {host}"
        try:
            yield
        except ApiException as exc:
            raise _api_error(exc, what, self.namespace) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise LeaseAPIUnavailableError(
                f"cannot {what}: the Kubernetes API is unreachable ({exc})"
            ) from exc


def _api_error(exc: ApiException, what: str, namespace: str) -> LeaseError:
    status = exc.status or 0
    reason, message = exc.reason or "", ""
    try:
        body = json.loads(exc.body or "")
        if isinstance(body, dict):  # a metav1 Status
            reason = body.get("reason") or reason
            message = body.get("message") or ""
    except ValueError:
        message = (exc.body or "")[:200]
    if status == 401:
        return LeaseUnauthorizedError(
            f"cannot {what}: the API server refused our credentials (401 {reason}): check the "
            "kubeconfig's user, or the pod's service account token",
            status=status, reason=reason, message=message,
        )
    if status == 403:
        return LeaseForbiddenError(
            f"cannot {what}: forbidden (403): {message}. The identity needs get, create and update "
            f"(delete for teardown) on leases.coordination.k8s.io in namespace {namespace!r}: "
            "see deploy/coordinator/rbac.yaml",
            status=status, reason=reason, message=message,
        )
    if status == 429 or status >= 500:
        return LeaseAPIUnavailableError(
            f"cannot {what}: the API server answered {status} {reason}: {message}", status=status
        )
    return LeaseAPIError(
        f"cannot {what}: {status} {reason}: {message}", status=status, reason=reason, message=message
    )
