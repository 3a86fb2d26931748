"""The Lease serving lock, through the official client, against tests/k8s_api.py.

No Kubernetes API server runs here: the server is an in-suite one that
implements the Lease endpoints' documented semantics (see its docstring).
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

pytest.importorskip("kubernetes", reason="the Lease lock needs pip install 'gms[k8s]'")
from kubernetes import client as k8s  # noqa: E402
from kubernetes.client.exceptions import ApiException  # noqa: E402

from gms.failover.lease import (  # noqa: E402
    LeaseAPIError,
    LeaseAPIUnavailableError,
    LeaseConfigError,
    LeaseForbiddenError,
    LeaseServingLock,
    LeaseUnauthorizedError,
)
from gms.failover.lock import ServingLock  # noqa: E402

from .k8s_api import FakeLeaseAPI, micro_time  # noqa: E402

NS = "gms"
NAME = "gms-serving"


@pytest.fixture
def api():
    with FakeLeaseAPI(namespaces=(NS,)) as server:
        yield server


def write_kubeconfig(path, server: str, token: str, namespace: str = NS) -> str:
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: test
  cluster: {{server: "{server}"}}
users:
- name: test
  user: {{token: "{token}"}}
contexts:
- name: test
  context: {{cluster: test, user: test, namespace: {namespace}}}
current-context: test
"""
    )
    return str(path)


@pytest.fixture
def kubeconfig(api, tmp_path, monkeypatch):
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return write_kubeconfig(tmp_path / "kubeconfig", api.url, api.token)


@pytest.fixture
def make(kubeconfig):
    """A new lock (its own ApiClient, as another process would have) on the same Lease."""

    def make(duration_s: int = 15, **kw) -> LeaseServingLock:
        return LeaseServingLock(NAME, duration_s=duration_s, kubeconfig=kubeconfig, **kw)

    return make


def spec(api) -> dict:
    return api.get(NS, NAME)["spec"]


def test_acquire_renew_release(api, make):
    lock = make()
    assert isinstance(lock, ServingLock)
    assert lock.namespace == NS  # from the kubeconfig's context
    assert lock.holder() is None and lock.record() is None

    assert lock.try_acquire("primary")
    first = lock.record()
    assert (first.holder, first.duration_s, first.transitions) == ("primary", 15, 0)
    assert first.acquire_time == first.renew_time
    assert lock.holder() == "primary"
    raw = api.get(NS, NAME)
    assert raw["spec"]["holderIdentity"] == "primary"
    assert raw["metadata"]["managedFields"][0]["manager"] == "OpenAPI-Generator"

    time.sleep(0.01)
    assert lock.try_acquire("primary")  # a renewal
    renewed = lock.record()
    assert int(renewed.resource_version) > int(first.resource_version)
    assert renewed.renew_time > first.renew_time
    assert (renewed.acquire_time, renewed.transitions) == (first.acquire_time, 0)

    assert not lock.try_acquire("shadow")  # held and live
    assert lock.holder() == "primary"

    lock.release("primary")
    assert lock.holder() is None
    assert spec(api)["holderIdentity"] == "" and spec(api)["leaseDurationSeconds"] == 1

    assert lock.try_acquire("shadow")
    taken = lock.record()
    assert (taken.holder, taken.transitions, taken.duration_s) == ("shadow", 1, 15)
    assert taken.acquire_time > first.acquire_time


def test_two_contenders_on_a_new_lease_one_wins(api, make):
    primary, shadow = make(), make()
    # Both read "no Lease"; shadow's create lands between primary's read and create.
    api.before_next("POST", lambda: shadow.try_acquire("shadow"))
    assert primary.try_acquire("primary") is False  # 409 AlreadyExists: lost, not raised
    assert primary.holder() == shadow.holder() == "shadow"
    assert spec(api)["leaseTransitions"] == 0


@pytest.mark.parametrize("released_first", [False, True], ids=["create", "update"])
def test_many_contenders_at_once_exactly_one_wins(api, make, released_first):
    if released_first:  # contend on an existing, released Lease: a replace race
        first = make()
        assert first.try_acquire("earlier")
        first.release("earlier")
    locks = [make() for _ in range(6)]
    barrier = threading.Barrier(len(locks))
    results: dict[str, bool] = {}

    def contend(n: int) -> None:
        barrier.wait()
        results[f"set-{n}"] = locks[n].try_acquire(f"set-{n}")

    threads = [threading.Thread(target=contend, args=(n,)) for n in range(len(locks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    winners = [h for h, won in results.items() if won]
    assert len(results) == len(locks) and len(winners) == 1
    assert locks[0].holder() == winners[0]
    assert spec(api)["leaseTransitions"] == (1 if released_first else 0)


def test_expired_lease_is_taken_over(api, make):
    primary, shadow = make(duration_s=1), make(duration_s=1)
    assert primary.try_acquire("primary")
    assert not shadow.try_acquire("shadow")
    expires = primary.record().expires_at
    time.sleep(max(0.0, (expires - datetime.now(UTC)).total_seconds()) + 0.05)

    assert shadow.holder() is None  # expired is free
    assert shadow.try_acquire("shadow")
    record = shadow.record()
    assert (record.holder, record.transitions) == ("shadow", 1)
    assert not primary.try_acquire("primary")  # the old holder cannot take it back while live
    assert shadow.holder() == "shadow"


def test_stale_resource_version_loses(api, make):
    # A Lease another client held and let lapse, 3 transitions in.
    long_ago = micro_time(datetime.now(UTC) - timedelta(minutes=5))
    api.put_raw(NS, NAME, {"holderIdentity": "crashed", "leaseDurationSeconds": 15,
                           "acquireTime": long_ago, "renewTime": long_ago, "leaseTransitions": 3})
    a, b = make(), make()
    # Both read the expired Lease at the same resourceVersion; b's replace lands first.
    api.before_next("PUT", lambda: b.try_acquire("b"))
    assert a.try_acquire("a") is False  # a's replace carried the stale resourceVersion: 409
    record = a.record()
    assert (record.holder, record.transitions) == ("b", 4)  # one takeover, counted once


def test_release_by_a_non_holder_is_a_no_op(api, make):
    owner, other = make(), make()
    other.release("primary")  # no Lease at all: nothing happens
    assert api.get(NS, NAME) is None
    assert owner.try_acquire("primary")
    before = api.get(NS, NAME)
    writes = len([m for m, _ in api.requests if m != "GET"])
    other.release("shadow")
    assert api.get(NS, NAME) == before  # same resourceVersion: nothing written
    assert len([m for m, _ in api.requests if m != "GET"]) == writes
    assert owner.holder() == "primary"


def test_release_retries_past_a_concurrent_renewal(api, make):
    lock, same_holder_elsewhere = make(), make()
    assert lock.try_acquire("primary")
    # The holder renews (another process of the same set) between release's read and write.
    api.before_next("PUT", lambda: same_holder_elsewhere.try_acquire("primary"))
    lock.release("primary")
    assert lock.holder() is None


def test_release_does_not_undo_a_takeover(api, make):
    old, new = make(duration_s=1), make(duration_s=1)
    assert old.try_acquire("old")
    time.sleep(1.05)
    assert new.try_acquire("new")
    old.release("old")  # too late: it is no longer ours
    assert new.holder() == "new"


def test_a_whole_second_time_goes_back_with_six_digits(api, make):
    """The client's isoformat drops '.000000'; the API server's MicroTime parser demands it."""
    whole = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1)
    api.put_raw(NS, NAME, {"holderIdentity": "primary", "leaseDurationSeconds": 15,
                           "acquireTime": micro_time(whole), "renewTime": micro_time(datetime.now(UTC)),
                           "leaseTransitions": 0})
    lock = make()
    assert lock.try_acquire("primary")  # a renewal keeps acquireTime: sent back, accepted
    assert abs(lock.record().acquire_time - whole) < timedelta(milliseconds=1)


def test_the_server_refuses_what_the_api_refuses(api, kubeconfig):
    """The in-suite server's own checks: without them the tests above prove less."""
    from kubernetes import config as k8s_config

    raw = k8s.CoordinationV1Api(k8s_config.new_client_from_config(kubeconfig, persist_config=False))
    body = k8s.V1Lease(metadata=k8s.V1ObjectMeta(name=NAME), spec=k8s.V1LeaseSpec(
        holder_identity="x", lease_duration_seconds=5, renew_time=datetime(2026, 1, 1, tzinfo=UTC)))
    with pytest.raises(ApiException) as exc:  # isoformat wrote no fraction
        raw.create_namespaced_lease(NS, body)
    assert exc.value.status == 400
    body.spec.renew_time = None
    created = raw.create_namespaced_lease(NS, body)
    with pytest.raises(ApiException) as exc:
        raw.create_namespaced_lease(NS, body)
    assert (exc.value.status, '"AlreadyExists"' in exc.value.body) == (409, True)
    stale = created.metadata.resource_version
    raw.replace_namespaced_lease(NAME, NS, created)
    with pytest.raises(ApiException) as exc:
        raw.replace_namespaced_lease(NAME, NS, created)
    assert (exc.value.status, '"Conflict"' in exc.value.body) == (409, True)
    created.metadata.resource_version = None
    with pytest.raises(ApiException) as exc:
        raw.replace_namespaced_lease(NAME, NS, created)
    assert exc.value.status == 422
    created.metadata.resource_version = stale  # a stale version is refused before validation
    with pytest.raises(ApiException) as exc:
        raw.replace_namespaced_lease(NAME, NS, created)
    assert exc.value.status == 409
    created.metadata.resource_version = raw.read_namespaced_lease(NAME, NS).metadata.resource_version
    created.spec.lease_duration_seconds = 0
    with pytest.raises(ApiException) as exc:
        raw.replace_namespaced_lease(NAME, NS, created)
    assert exc.value.status == 422
    with pytest.raises(ApiException) as exc:
        raw.read_namespaced_lease("absent", NS)
    assert (exc.value.status, '"NotFound"' in exc.value.body) == (404, True)


def test_delete(api, make):
    lock = make()
    assert lock.delete() is False
    assert lock.try_acquire("primary")
    assert lock.delete() is True
    assert api.get(NS, NAME) is None and lock.holder() is None


def test_unreachable_api_is_a_typed_error():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = k8s.Configuration(host=f"http://127.0.0.1:{port}")
    lock = LeaseServingLock(NAME, NS, api_client=k8s.ApiClient(cfg), request_timeout_s=2)
    for call in (lambda: lock.try_acquire("primary"), lock.holder, lambda: lock.release("primary")):
        with pytest.raises(LeaseAPIUnavailableError, match=f"unreachable.*127.0.0.1:{port}|127.0.0.1:{port}.*unreachable"):
            call()


def test_rbac_refusal_is_a_typed_error(api, make):
    lock = make()
    assert lock.try_acquire("primary")  # get and create allowed
    api.forbidden = {"update"}
    with pytest.raises(LeaseForbiddenError) as exc:
        lock.try_acquire("primary")
    assert exc.value.status == 403
    assert 'cannot update resource "leases"' in str(exc.value) and "rbac.yaml" in str(exc.value)
    api.forbidden = {"get"}
    with pytest.raises(LeaseForbiddenError):
        lock.holder()


def test_bad_credentials_are_a_typed_error(api, tmp_path, monkeypatch):
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    wrong = write_kubeconfig(tmp_path / "kc", api.url, "not-the-token")
    with pytest.raises(LeaseUnauthorizedError) as exc:
        LeaseServingLock(NAME, kubeconfig=wrong).try_acquire("primary")
    assert exc.value.status == 401


def test_missing_namespace_is_an_api_error(api, make):
    lock = make(namespace="nope")
    with pytest.raises(LeaseAPIError) as exc:
        lock.try_acquire("primary")
    assert exc.value.status == 404 and 'namespaces "nope" not found' in str(exc.value)


def test_no_cluster_configuration_is_a_typed_error(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    with pytest.raises(LeaseConfigError, match="kubeconfig"):
        LeaseServingLock(NAME, NS)


def test_an_api_client_and_an_explicit_namespace(api):
    cfg = k8s.Configuration(host=api.url, api_key={"authorization": api.token},
                            api_key_prefix={"authorization": "Bearer"})
    lock = LeaseServingLock("other", NS, api_client=k8s.ApiClient(cfg), duration_s=3)
    assert lock.try_acquire("primary")
    assert api.get(NS, "other")["spec"]["leaseDurationSeconds"] == 3


def test_arguments_are_checked(api, make):
    with pytest.raises(ValueError):
        make(duration_s=0)
    with pytest.raises(ValueError):
        make().try_acquire("")
