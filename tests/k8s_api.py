"""A Kubernetes API server for Leases only, to the API's documented semantics.

No real API server can run here, so the Lease lock is tested against this one:
a real HTTP server on a loopback socket (the stdlib's ``ThreadingHTTPServer``
in a thread) that the official ``kubernetes`` client talks to unchanged. It
implements what the lock relies on, as the API server does it
(k8s.io/apiserver's generic registry with the Lease strategy):

* ``GET/POST /apis/coordination.k8s.io/v1/namespaces/{ns}/leases`` and
  ``GET/PUT/DELETE .../leases/{name}``, JSON in and out, objects shaped as the
  API returns them (``kind``, ``apiVersion``, ``metadata.uid``,
  ``resourceVersion``, ``creationTimestamp``, ``managedFields``);
* one ``resourceVersion`` counter for the whole store, as etcd's revision,
  advanced by every write;
* PUT: 422 Invalid without ``metadata.resourceVersion`` (Leases do not allow
  unconditional updates), 409 Conflict on a stale one, 409 on a ``uid``
  precondition that no longer matches (the object was deleted, perhaps
  recreated), create-on-update when the Lease does not exist (Leases allow it);
  400 when the body's name or namespace disagrees with the URL;
* POST: 409 AlreadyExists for an existing name, 404 for a namespace that does
  not exist, 500 when the body carries a resourceVersion;
* DELETE: ``preconditions`` (uid, resourceVersion) in DeleteOptions, 409 when
  one fails, a Success Status otherwise;
* errors as ``metav1.Status`` bodies (kind, apiVersion, status, message,
  reason, details, code);
* MicroTime (``acquireTime``, ``renewTime``) parsed as Go's RFC3339Micro
  layout does: exactly six fractional digits and a zone, else 400; written back
  as UTC, ``2026-11-22T10:00:00.000000Z``;
* validation (422): ``leaseDurationSeconds`` > 0, ``leaseTransitions`` >= 0,
  the name a DNS subdomain;
* authentication by bearer token (401) and, optionally, RBAC verbs refused
  (403 Forbidden, the API's message).

Tests may run a callable just before a request of a given method is handled
(:meth:`FakeLeaseAPI.before_next`), outside the store's lock, to place a
competing write exactly between a client's read and its write.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

GROUP = "coordination.k8s.io"
API_VERSION = f"{GROUP}/v1"
_PATH = re.compile(rf"^/apis/{re.escape(GROUP)}/v1/namespaces/([^/]+)/leases(?:/([^/]+))?/?$")
# Go's RFC3339Micro ("2006-01-02T15:04:05.000000Z07:00"): six digits, a zone.
_MICRO = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}(Z|[+-]\d\d:\d\d)$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_VERBS = {"GET": "get", "POST": "create", "PUT": "update", "DELETE": "delete"}


class ApiError(Exception):
    """Answered as a metav1.Status."""

    def __init__(self, code: int, reason: str, message: str, details: dict | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> dict:
        body = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def _details(name: str | None) -> dict:
    d = {"group": GROUP, "kind": "leases"}
    return {"name": name, **d} if name else d


def not_found(name: str) -> ApiError:
    return ApiError(404, "NotFound", f'leases.{GROUP} "{name}" not found', _details(name))


def conflict(name: str, why: str) -> ApiError:
    return ApiError(
        409, "Conflict", f'Operation cannot be fulfilled on leases.{GROUP} "{name}": {why}', _details(name)
    )


OPTIMISTIC_LOCK = "the object has been modified; please apply your changes to the latest version and try again"


def invalid(name: str, field: str, value, detail: str) -> ApiError:
    cause = f"Invalid value: {json.dumps(value)}: {detail}"
    return ApiError(
        422,
        "Invalid",
        f'Lease.{GROUP} "{name}" is invalid: {field}: {cause}',
        {"name": name, "group": GROUP, "kind": "Lease",
         "causes": [{"reason": "FieldValueInvalid", "message": cause, "field": field}]},
    )


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def micro_time(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_micro(value, field: str) -> str:
    """Decode a MicroTime as Go does and re-encode it as the API writes it."""
    if not isinstance(value, str) or not _MICRO.match(value):
        raise bad_request(
            f'Lease in version "v1" cannot be handled as a Lease: {field}: parsing time '
            f'{json.dumps(value)} as "2006-01-02T15:04:05.000000Z07:00": cannot parse'
        )
    return micro_time(datetime.fromisoformat(value))


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class FakeLeaseAPI:
    """The server. ``with FakeLeaseAPI() as api:`` ... ``api.url``, ``api.token``."""

    def __init__(self, namespaces=("default",), token: str = "test-token",
                 user: str = "system:serviceaccount:default:gms-coordinator") -> None:
        self.namespaces = set(namespaces)
        self.token = token
        self.user = user
        self.forbidden: set[str] = set()  # RBAC verbs refused with 403
        self.requests: list[tuple[str, str]] = []  # (method, path) in order of arrival
        self._objects: dict[tuple[str, str], dict] = {}
        self._revision = 1000
        self._lock = threading.Lock()
        self._hooks: dict[str, Callable[[], None]] = {}
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="fake-k8s-api", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeLeaseAPI:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    # -- test controls

    def before_next(self, method: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` once, just before the next ``method`` request is handled."""
        self._hooks[method] = fn

    def get(self, namespace: str, name: str) -> dict | None:
        with self._lock:
            obj = self._objects.get((namespace, name))
            return json.loads(json.dumps(obj)) if obj else None

    def put_raw(self, namespace: str, name: str, spec: dict) -> dict:
        """Write a Lease as another client would (any valid spec), bypassing HTTP."""
        with self._lock:
            old = self._objects.get((namespace, name))
            obj = {"metadata": {"name": name, "namespace": namespace, **({"uid": old["metadata"]["uid"]} if old else {})},
                   "spec": spec}
            return self._store(namespace, name, obj, old, manager="test")

    # -- the API

    def handle(self, method: str, path: str, headers, body: bytes) -> tuple[int, dict]:
        self.requests.append((method, path))
        if hook := self._hooks.pop(method, None):
            hook()
        if headers.get("Authorization") != f"Bearer {self.token}":
            raise ApiError(401, "Unauthorized", "Unauthorized")
        match = _PATH.match(urlsplit(path).path)
        if not match:
            raise ApiError(404, "NotFound", "the server could not find the requested resource", {})
        namespace, name = match.groups()
        if method not in _VERBS or (name is None and method not in ("GET", "POST")) or (
            name is not None and method == "POST"
        ):
            raise ApiError(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")
        verb = "list" if (method == "GET" and name is None) else _VERBS[method]
        if verb in self.forbidden or (verb == "list" and "get" in self.forbidden):
            target = f'leases.{GROUP} "{name}"' if name else f"leases.{GROUP}"
            raise ApiError(
                403, "Forbidden",
                f'{target} is forbidden: User "{self.user}" cannot {verb} resource "leases" in API group '
                f'"{GROUP}" in the namespace "{namespace}"',
                _details(name),
            )
        manager = (headers.get("User-Agent") or "unknown").split("/")[0]
        with self._lock:
            if method == "GET" and name is None:
                return 200, self._list(namespace)
            if method == "GET":
                return 200, self._read(namespace, name)
            if method == "DELETE":
                return 200, self._delete(namespace, name, _json(body) if body else {})
            obj = _json(body)
            if method == "POST":
                return 201, self._create(namespace, obj, manager)
            return self._update(namespace, name, obj, manager)

    def _read(self, namespace: str, name: str) -> dict:
        obj = self._objects.get((namespace, name))
        if obj is None:
            raise not_found(name)
        return obj

    def _list(self, namespace: str) -> dict:
        items = [
            {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}
            for (ns, _), obj in sorted(self._objects.items()) if ns == namespace
        ]
        return {"kind": "LeaseList", "apiVersion": API_VERSION,
                "metadata": {"resourceVersion": str(self._revision)}, "items": items}

    def _create(self, namespace: str, obj: dict, manager: str) -> dict:
        meta = obj.get("metadata") or {}
        name = meta.get("name")
        if not name:
            raise invalid("", "metadata.name", "", "name or generateName is required")
        self._check_namespace(namespace, meta)
        if namespace not in self.namespaces:
            raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found',
                           {"name": namespace, "kind": "namespaces"})
        if meta.get("resourceVersion"):
            raise ApiError(500, "InternalError", "resourceVersion should not be set on objects to be created")
        if (namespace, name) in self._objects:
            raise ApiError(409, "AlreadyExists", f'leases.{GROUP} "{name}" already exists', _details(name))
        return self._store(namespace, name, obj, None, manager)

    def _update(self, namespace: str, name: str, obj: dict, manager: str) -> tuple[int, dict]:
        meta = obj.get("metadata") or {}
        if meta.get("name") != name:
            raise bad_request(f"the name of the object ({meta.get('name')}) does not match the name on the URL ({name})")
        self._check_namespace(namespace, meta)
        old = self._objects.get((namespace, name))
        uid = meta.get("uid")
        if uid and (old is None or old["metadata"]["uid"] != uid):
            # the generic registry turns a body's uid into a precondition
            have = old["metadata"]["uid"] if old else ""
            raise conflict(name, f"Precondition failed: UID in precondition: {uid}, UID in object meta: {have}")
        if old is None:  # Leases allow create-on-update
            if namespace not in self.namespaces:
                raise ApiError(404, "NotFound", f'namespaces "{namespace}" not found',
                               {"name": namespace, "kind": "namespaces"})
            return 201, self._store(namespace, name, obj, None, manager)
        rv = meta.get("resourceVersion")
        if not rv:
            raise ApiError(
                422, "Invalid",
                f'leases.{GROUP} "{name}" is invalid: metadata.resourceVersion: Invalid value: 0x0: '
                "must be specified for an update",
                {"name": name, "group": GROUP, "kind": "leases", "causes": [
                    {"reason": "FieldValueInvalid", "message": "Invalid value: 0x0: must be specified for an update",
                     "field": "metadata.resourceVersion"}]},
            )
        if not rv.isdigit():
            raise bad_request(f"invalid resource version: {rv}")
        if rv != old["metadata"]["resourceVersion"]:
            raise conflict(name, OPTIMISTIC_LOCK)
        return 200, self._store(namespace, name, obj, old, manager)

    def _delete(self, namespace: str, name: str, options: dict) -> dict:
        old = self._read(namespace, name)
        pre = options.get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != old["metadata"]["uid"]:
            raise conflict(name, f"Precondition failed: UID in precondition: {pre['uid']}, "
                                 f"UID in object meta: {old['metadata']['uid']}")
        if pre.get("resourceVersion") and pre["resourceVersion"] != old["metadata"]["resourceVersion"]:
            raise conflict(name, f"Precondition failed: ResourceVersion in precondition: {pre['resourceVersion']}, "
                                 f"ResourceVersion in object meta: {old['metadata']['resourceVersion']}")
        del self._objects[(namespace, name)]
        self._revision += 1
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": {**_details(name), "uid": old["metadata"]["uid"]}}

    @staticmethod
    def _check_namespace(namespace: str, meta: dict) -> None:
        if meta.get("namespace") not in (None, "", namespace):
            raise bad_request("the namespace of the provided object does not match the namespace sent on the request")

    def _store(self, namespace: str, name: str, obj: dict, old: dict | None, manager: str) -> dict:
        """Validate, fill the system fields, advance the revision, keep and return the object."""
        if obj.get("kind") not in (None, "Lease") or obj.get("apiVersion") not in (None, API_VERSION):
            raise bad_request(f"the API version in the data ({obj.get('apiVersion')}) does not match the "
                              f"expected API version ({API_VERSION})")
        if not _DNS_SUBDOMAIN.match(name) or len(name) > 253:
            raise invalid(name, "metadata.name", name, "a lowercase RFC 1123 subdomain must consist of lower "
                          "case alphanumeric characters, '-' or '.'")
        spec = dict(obj.get("spec") or {})
        for field in ("acquireTime", "renewTime"):
            if field in spec and spec[field] is not None:
                spec[field] = _parse_micro(spec[field], f"spec.{field}")
        for field in ("leaseDurationSeconds", "leaseTransitions"):
            if field in spec and (type(spec[field]) is not int or not -(2**31) <= spec[field] < 2**31):
                raise bad_request(f'Lease in version "v1" cannot be handled as a Lease: spec.{field}: '
                                  "expected an int32")
        if spec.get("leaseDurationSeconds") is not None and spec["leaseDurationSeconds"] <= 0:
            raise invalid(name, "spec.leaseDurationSeconds", spec["leaseDurationSeconds"], "must be greater than 0")
        if spec.get("leaseTransitions") is not None and spec["leaseTransitions"] < 0:
            raise invalid(name, "spec.leaseTransitions", spec["leaseTransitions"],
                          "must be greater than or equal to 0")
        self._revision += 1
        meta = {k: v for k, v in (obj.get("metadata") or {}).items()
                if k in ("labels", "annotations", "ownerReferences")}
        meta.update(
            name=name,
            namespace=namespace,
            uid=old["metadata"]["uid"] if old else str(uuid.uuid4()),
            resourceVersion=str(self._revision),
            creationTimestamp=old["metadata"]["creationTimestamp"] if old else _now_rfc3339(),
            managedFields=[{
                "manager": manager,
                "operation": "Update",
                "apiVersion": API_VERSION,
                "time": _now_rfc3339(),
                "fieldsType": "FieldsV1",
                "fieldsV1": {"f:spec": {f"f:{k}": {} for k in sorted(spec) if spec[k] is not None}},
            }],
        )
        stored = {"kind": "Lease", "apiVersion": API_VERSION, "metadata": meta,
                  "spec": {k: v for k, v in spec.items() if v is not None}}
        self._objects[(namespace, name)] = stored
        return stored


def _json(body: bytes) -> dict:
    try:
        obj = json.loads(body)
    except ValueError as exc:
        raise bad_request(f"the body of the request was in an unknown format: {exc}") from None
    if not isinstance(obj, dict):
        raise bad_request("the body of the request was in an unknown format")
    return obj


def _handler(api: FakeLeaseAPI):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the client's connection pool expects

        def setup(self) -> None:
            super().setup()
            # headers and body go out as two writes: without this, Nagle's algorithm
            # and the client's delayed ACK hold every reply for 40 ms
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            try:
                code, reply = api.handle(self.command, self.path, self.headers, body)
            except ApiError as err:
                code, reply = err.code, err.status()
            data = json.dumps(reply).encode()
            self.send_response(code, HTTPStatus(code).phrase)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve

        def log_message(self, *args) -> None:  # quiet: tests read api.requests instead
            pass

    return Handler
