"""The operator's tenant policy: who (by uid/gid) is which tenant, with what quota and rights.

A TOML file, one ``[[tenant]]`` table per tenant::

    [[tenant]]
    name = "inference"
    uids = [1000, 1001]          # peers whose uid is listed are this tenant
    gids = [2000]                # else peers whose gid is listed (uids match first)
    quota = "40GiB"              # bytes it may keep in gms; omit for unlimited
    metadata_quota = "64MiB"     # metadata keys and values it may keep (the server's RAM)
    max_layouts = 256            # layouts it may own or write at once
    disk_quota = "200GiB"        # snapshots of its layouts on the disk tier; omit for unlimited
    persist = true               # its commits save a snapshot unless the writer says otherwise
    read = ["llama-*", "shared"] # layouts it may read (fnmatch patterns)
    write = ["llama-*", "kv-*"]  # layouts it may write (and so read)
    admin = false                # may revoke, evict and pin

Identity always comes from the kernel (the socket's peer credentials); a
client never names its tenant.  Without a policy everyone who can open the
socket is one tenant, ``default``, unlimited, reading and writing every
layout (bounded only by the node's own limits).  A tenant that sets no
``metadata_quota`` or ``max_layouts`` gets the server's defaults
(``gms serve --tenant-metadata-quota``, ``--tenant-max-layouts``).  Errors
name the file and line.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib

import attrs

from ..fsm import DEFAULT_TENANT
from ..units import parse_bytes

_TENANT_KEYS = {
    "name", "uids", "gids", "quota", "metadata_quota", "max_layouts", "read", "write", "admin", "disk_quota", "persist",
}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class PolicyError(ValueError):
    """The policy file cannot be used; the message names the file and line."""


@attrs.frozen
class TenantPolicy:
    name: str
    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()
    quota_bytes: int | None = None
    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    admin: bool = False
    everyone: bool = False  # the default tenant of a server without a policy
    metadata_quota: int | None = None  # None: the server's default
    max_layouts: int | None = None  # None: the server's default
    disk_quota: int | None = None  # None: unlimited (the disk tier's budget bounds it)
    persist: bool = False  # a commit that does not say saves a snapshot (gms.disk)

    def may_write(self, layout: str) -> bool:
        return self.everyone or any(fnmatch.fnmatchcase(layout, p) for p in self.write)

    def may_read(self, layout: str) -> bool:
        return self.may_write(layout) or any(fnmatch.fnmatchcase(layout, p) for p in self.read)


@attrs.frozen
class Policy:
    tenants: tuple[TenantPolicy, ...]
    source: str = ""

    def may_write(self, tenant: str, layout: str) -> bool:
        """Whether the tenant named ``tenant`` may write ``layout`` (a snapshot's owner
        is checked as its writer would have been)."""
        return any(t.name == tenant and t.may_write(layout) for t in self.tenants)

    def tenant_for(self, uid: int, gid: int) -> TenantPolicy | None:
        for tenant in self.tenants:
            if tenant.everyone or uid in tenant.uids:
                return tenant
        return next((t for t in self.tenants if gid in t.gids), None)

    def is_admin(self, uid: int, gid: int, server_uid: int) -> bool:
        """Root, the server's own uid, or a tenant the policy makes admin."""
        if uid in (0, server_uid):
            return True
        tenant = self.tenant_for(uid, gid)
        return tenant is not None and tenant.admin and not tenant.everyone

    def persists(self, tenant: str) -> bool:
        """Whether ``tenant``'s commits save a snapshot unless the writer says."""
        return any(t.persist for t in self.tenants if t.name == tenant)

    def quotas(self) -> dict[str, int | None]:
        return {t.name: t.quota_bytes for t in self.tenants}

    def tenant_limits(self, metadata_quota: int | None, max_layouts: int | None) -> dict[str, dict]:
        """Each tenant's metadata quota and layout bound, the server's defaults
        filled in (``SERVER_STARTED.tenant_limits``).  The one tenant of a server
        without a policy has none of its own: the node's limits bound it."""
        return {
            t.name: {
                "metadata_quota": None if t.everyone else _or(t.metadata_quota, metadata_quota),
                "max_layouts": None if t.everyone else _or(t.max_layouts, max_layouts),
                "disk_quota": t.disk_quota,
            }
            for t in self.tenants
        }


def _or(value: int | None, default: int | None) -> int | None:
    return default if value is None else value


OPEN_POLICY = Policy((TenantPolicy(DEFAULT_TENANT, everyone=True),), source="(no policy)")


def load_policy(path: str) -> Policy:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise PolicyError(f"{path}: cannot read the policy: {exc}") from exc
    return parse_policy(text, path)


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"{source}: not valid TOML: {exc}") from exc
    lines = _Lines(text, source)
    for key in document:
        if key != "tenant":
            raise lines.error(None, key, f"unknown table or key {key!r} (expected [[tenant]] tables)")
    tables = document.get("tenant", [])
    if not isinstance(tables, list) or not tables:
        raise PolicyError(f"{source}: no [[tenant]] tables: a policy names at least one tenant")
    tenants: list[TenantPolicy] = []
    owners: dict[tuple[str, int], str] = {}
    for index, table in enumerate(tables):
        tenant = _tenant(table, index, lines)
        if any(t.name == tenant.name for t in tenants):
            raise lines.error(index, "name", f"tenant {tenant.name!r} is defined twice")
        for kind, ids in (("uid", tenant.uids), ("gid", tenant.gids)):
            for n in ids:
                if (kind, n) in owners:
                    raise lines.error(
                        index, f"{kind}s", f"{kind} {n} belongs to both {owners[kind, n]!r} and {tenant.name!r}"
                    )
                owners[kind, n] = tenant.name
        tenants.append(tenant)
    return Policy(tuple(tenants), source)


def _tenant(table: dict, index: int, lines: _Lines) -> TenantPolicy:
    for key in table:
        if key not in _TENANT_KEYS:
            raise lines.error(index, key, f"unknown key {key!r}; allowed: {', '.join(sorted(_TENANT_KEYS))}")
    name = table.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise lines.error(index, "name", "every tenant needs a name of letters, digits, '.', '_' or '-'")

    def ids(key: str) -> frozenset[int]:
        value = table.get(key, [])
        if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
            raise lines.error(index, key, f"{key} must be a list of non-negative integers")
        return frozenset(value)

    def patterns(key: str) -> tuple[str, ...]:
        value = table.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise lines.error(index, key, f"{key} must be a list of layout name patterns")
        return tuple(value)

    def size(key: str) -> int | None:
        value = table.get(key)
        if value is None:
            return None
        try:
            return parse_bytes(value)
        except ValueError as exc:
            raise lines.error(index, key, f"{key}: {exc}") from None

    quota, metadata_quota, disk_quota = size("quota"), size("metadata_quota"), size("disk_quota")
    persist = table.get("persist", False)
    if not isinstance(persist, bool):
        raise lines.error(index, "persist", "persist must be true or false")
    max_layouts = table.get("max_layouts")
    if max_layouts is not None and (type(max_layouts) is not int or max_layouts < 0):
        raise lines.error(index, "max_layouts", "max_layouts must be a non-negative integer")
    admin = table.get("admin", False)
    if not isinstance(admin, bool):
        raise lines.error(index, "admin", "admin must be true or false")
    uids, gids = ids("uids"), ids("gids")
    if not uids and not gids:
        raise lines.error(index, "name", f"tenant {name!r} lists no uids or gids: nobody could be it")
    return TenantPolicy(
        name, uids, gids, quota, patterns("read"), patterns("write"), admin,
        metadata_quota=metadata_quota, max_layouts=max_layouts, disk_quota=disk_quota, persist=persist,
    )


class _Lines:
    """Finds the line of a key in the n-th ``[[tenant]]`` table, for error messages."""

    def __init__(self, text: str, source: str) -> None:
        self.source = source
        self.lines = text.splitlines()
        self.headers = [i for i, line in enumerate(self.lines) if re.match(r"\s*\[\[\s*tenant\s*\]\]", line)]

    def error(self, index: int | None, key: str, message: str) -> PolicyError:
        if index is None:
            start, stop = 0, len(self.lines)
        else:
            start = self.headers[index] if index < len(self.headers) else 0
            stop = self.headers[index + 1] if index + 1 < len(self.headers) else len(self.lines)
        pattern = re.compile(rf"\s*(\[+\s*)?{re.escape(key)}\s*(=|\])")
        line = next((i for i in range(start, stop) if pattern.match(self.lines[i])), start)
        return PolicyError(f"{self.source}:{line + 1}: {message}")
