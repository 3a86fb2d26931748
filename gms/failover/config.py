"""The coordinator's configuration: a TOML file, read into frozen data.

::

    lock = "file:/run/gms/serving.lock"      # or "lease:NAMESPACE/NAME" (a Kubernetes Lease)
    initial = "A"                            # the set that serves first (unless the lock names another)
    ranks = ["/tmp/gms_GPU-0.sock", "/tmp/gms_GPU-1.sock"]   # each rank's gms server (one per GPU)
    interval_s = 0.5                         # between probes
    failures = 3                             # failed canaries in a row that make a failure
    canary_timeout_s = 5.0                   # a probe slower than this failed
    wake_timeout_s = 600.0                   # a wake may wait for memory a dead engine still holds
    ready_timeout_s = 600.0                  # a (re)started set must be ready within this
    events = "/var/log/gms-failover.jsonl"   # optional: JSON lines also go there
    health_path = "/health"                  # the canary's path ("/gms/health" for vLLM engines:
                                             # docs/vllm.md)
    revoke = "server"                        # or "engines": the new set's engines revoke the KV
                                             # layout on their own node as they wake (a coordinator
                                             # off the GPU nodes cannot reach the sockets; ranks
                                             # then only name the ranks)

    [sets.A]                                 # local processes, one per rank
    kind = "local"
    ports = [8100, 8101]
    command = ["python", "examples/engine", "--model", "/models/m", "--gms-socket", "{socket}",
               "--port", "{port}", "--rank", "{rank}", "--world-size", "{world_size}", "--device", "{rank}"]
    env = { OMP_NUM_THREADS = "1" }
    log_dir = "/var/log/engines"

    [sets.B]                                 # or pods, found by label
    kind = "kubernetes"
    namespace = "llm"
    selector = "app=llm,gms.failover/set=B"
    rank_label = "gms.failover/rank"
    port = 8000

Placeholders in ``command`` and ``env`` values: ``{rank}``, ``{world_size}``,
``{port}``, ``{socket}``, ``{set}``.  The coordinator sets ``GMS_MODE``.
"""

from __future__ import annotations

import os
import tomllib

import attrs


class ConfigError(ValueError):
    pass


@attrs.frozen
class LocalSetConfig:
    name: str
    command: tuple[str, ...]
    ports: tuple[int, ...]
    host: str = "127.0.0.1"
    env: tuple[tuple[str, str], ...] = ()
    log_dir: str | None = None


@attrs.frozen
class KubernetesSetConfig:
    name: str
    namespace: str
    selector: str
    port: int = 8000
    rank_label: str = "gms.failover/rank"


SetConfig = LocalSetConfig | KubernetesSetConfig


@attrs.frozen
class CoordinatorConfig:
    lock: str
    initial: str
    ranks: tuple[str, ...]
    sets: tuple[SetConfig, ...]
    interval_s: float = 0.5
    failures: int = 3
    canary_timeout_s: float = 5.0
    wake_timeout_s: float = 600.0
    ready_timeout_s: float = 600.0
    events: str | None = None
    # Who revokes the failed set's KV layout: the coordinator on each rank's
    # gms socket ("server"), or each rank's new engine on its own node as it
    # wakes ("engines": for a coordinator that cannot reach the sockets).
    revoke: str = "server"
    # Where an engine answers the canary ({"status": "serving" | "asleep"}):
    # the example engine at /health, vLLM with the gms plugin at /gms/health.
    health_path: str = "/health"

    def set(self, name: str) -> SetConfig:
        return next(s for s in self.sets if s.name == name)

    @property
    def world_size(self) -> int:
        return len(self.ranks)


def _set(name: str, table: dict, world_size: int) -> SetConfig:
    kind = table.get("kind", "local")
    if kind == "local":
        ports = tuple(int(p) for p in table.get("ports", ()))
        if len(ports) != world_size:
            raise ConfigError(f"sets.{name}: {len(ports)} ports for {world_size} ranks")
        command = tuple(str(c) for c in table.get("command", ()))
        if not command:
            raise ConfigError(f"sets.{name}: a local set needs a command")
        env = tuple((str(k), str(v)) for k, v in table.get("env", {}).items())
        return LocalSetConfig(name, command, ports, table.get("host", "127.0.0.1"), env, table.get("log_dir"))
    if kind == "kubernetes":
        try:
            return KubernetesSetConfig(name, table["namespace"], table["selector"], int(table.get("port", 8000)),
                                       table.get("rank_label", "gms.failover/rank"))
        except KeyError as exc:
            raise ConfigError(f"sets.{name}: a kubernetes set needs {exc}") from None
    raise ConfigError(f"sets.{name}: unknown kind {kind!r} (local or kubernetes)")


def parse(data: dict) -> CoordinatorConfig:
    ranks = tuple(str(r) for r in data.get("ranks", ()))
    if not ranks:
        raise ConfigError("ranks: name each rank's gms socket")
    tables = data.get("sets", {})
    if len(tables) != 2:
        raise ConfigError(f"sets: exactly two engine sets (a primary and a shadow), not {len(tables)}")
    sets = tuple(_set(name, table, len(ranks)) for name, table in tables.items())
    initial = data.get("initial", sets[0].name)
    if initial not in tables:
        raise ConfigError(f"initial: {initial!r} is not a set")
    fields = {k: data[k] for k in ("interval_s", "canary_timeout_s", "wake_timeout_s", "ready_timeout_s")
              if k in data}
    revoke = data.get("revoke", "server")
    if revoke not in ("server", "engines"):
        raise ConfigError(f"revoke: 'server' or 'engines', not {revoke!r}")
    health_path = data.get("health_path", "/health")
    if not isinstance(health_path, str) or not health_path.startswith("/"):
        raise ConfigError(f"health_path: a path starting with '/', not {health_path!r}")
    config = CoordinatorConfig(
        lock=str(data.get("lock", "file:" + os.path.join(os.path.dirname(ranks[0]) or ".", "gms-serving.lock"))),
        initial=initial, ranks=ranks, sets=sets, failures=int(data.get("failures", 3)),
        events=data.get("events"), revoke=revoke, health_path=health_path, **{k: float(v) for k, v in fields.items()},
    )
    if config.failures < 1 or config.interval_s <= 0:
        raise ConfigError("failures must be >= 1 and interval_s > 0")
    return config


def load(path: str | os.PathLike) -> CoordinatorConfig:
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    return parse(data)
