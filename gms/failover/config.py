"""The coordinator's configuration: a TOML file, read into frozen data.

::

    lock = "file:/run/gms/serving.lock"      # or "lease:NAMESPACE/NAME" (a Kubernetes Lease)
    initial = "A"                            # the set that serves first (unless the lock names another)
    ranks = ["/tmp/gms_GPU-0.sock", "/tmp/gms_GPU-1.sock"]   # each rank's gms server (one per GPU)
    interval_s = 0.5                         # between probes
    failures = 3                             # failed canaries in a row that make a failure
    stall_s = 1.0                            # an engine that reports its progress: this long with
                                             # work pending and no model step done is a failure
    canary_timeout_s = 5.0                   # a probe slower than this failed
    wake_timeout_s = 600.0                   # a wake may wait for memory a dead engine still holds
    ready_timeout_s = 600.0                  # a (re)started set must be ready within this
    events = "/var/log/gms-failover.jsonl"   # optional: JSON lines also go there
    engine = "sglang"                        # optional: the paths of vLLM's or SGLang's gms plugin
                                             # (ENGINES below); each path may also be set alone:
    health_path = "/health"                  # the canary's path ("/gms/health" for vLLM and SGLang
                                             # engines: docs/vllm.md, docs/sglang.md)
    sleep_path = "/sleep"                    # put an engine to sleep, wake it (POST)
    wake_path = "/wake_up"
    revoke = "server"                        # or "engines": the new set's engines revoke the KV
                                             # layout on their own node as they wake (a coordinator
                                             # off the GPU nodes cannot reach the sockets; ranks
                                             # then only name the ranks)

    [sets.A]                                 # local processes: one per rank, or one engine
    kind = "local"                           # over every rank (tensor/pipeline parallel:
    ports = [8100, 8101]                     # ports = [8100]); each in its own process group
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
    engines = 2                              # pods: one per rank (default), or 1: one pod over every rank

Placeholders in ``command`` and ``env`` values: ``{rank}``, ``{world_size}``,
``{port}``, ``{socket}``, ``{set}``.  The coordinator sets ``GMS_MODE``.
"""

from __future__ import annotations

import os
import tomllib

import attrs


class ConfigError(ValueError):
    pass


# Where each engine answers the canary, sleeps and wakes: the example engine
# and vLLM (with the gms plugins) by vLLM's names; SGLang by its own endpoints.
ENGINES = {
    "example": {"health_path": "/health", "sleep_path": "/sleep", "wake_path": "/wake_up"},
    "vllm": {"health_path": "/gms/health", "sleep_path": "/sleep", "wake_path": "/wake_up"},
    "sglang": {"health_path": "/gms/health", "sleep_path": "/release_memory_occupation",
               "wake_path": "/resume_memory_occupation"},
}


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
    engines: int = 1  # pods: one per rank, or one over every rank (labelled rank 0)


SetConfig = LocalSetConfig | KubernetesSetConfig


@attrs.frozen
class CoordinatorConfig:
    lock: str
    initial: str
    ranks: tuple[str, ...]
    sets: tuple[SetConfig, ...]
    interval_s: float = 0.5
    failures: int = 3
    stall_s: float = 1.0
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
    sleep_path: str = "/sleep"
    wake_path: str = "/wake_up"

    def set(self, name: str) -> SetConfig:
        return next(s for s in self.sets if s.name == name)

    @property
    def world_size(self) -> int:
        return len(self.ranks)


def _set(name: str, table: dict, world_size: int) -> SetConfig:
    kind = table.get("kind", "local")
    if kind == "local":
        ports = tuple(int(p) for p in table.get("ports", ()))
        if len(ports) not in (1, world_size):
            raise ConfigError(f"sets.{name}: {len(ports)} ports for {world_size} ranks: one per rank (an engine "
                              "each) or one (an engine over every rank: tensor or pipeline parallel)")
        command = tuple(str(c) for c in table.get("command", ()))
        if not command:
            raise ConfigError(f"sets.{name}: a local set needs a command")
        env = tuple((str(k), str(v)) for k, v in table.get("env", {}).items())
        return LocalSetConfig(name, command, ports, table.get("host", "127.0.0.1"), env, table.get("log_dir"))
    if kind == "kubernetes":
        engines = int(table.get("engines", world_size))
        if engines not in (1, world_size):
            raise ConfigError(f"sets.{name}: engines = {engines} for {world_size} ranks: one per rank, or one "
                              "over every rank")
        try:
            return KubernetesSetConfig(name, table["namespace"], table["selector"], int(table.get("port", 8000)),
                                       table.get("rank_label", "gms.failover/rank"), engines)
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
    fields = {k: data[k] for k in ("interval_s", "canary_timeout_s", "wake_timeout_s", "ready_timeout_s", "stall_s")
              if k in data}
    revoke = data.get("revoke", "server")
    if revoke not in ("server", "engines"):
        raise ConfigError(f"revoke: 'server' or 'engines', not {revoke!r}")
    engine = data.get("engine", "example")
    if engine not in ENGINES:
        raise ConfigError(f"engine: one of {', '.join(ENGINES)}, not {engine!r}")
    paths = {key: data.get(key, default) for key, default in ENGINES[engine].items()}
    for key, path in paths.items():
        if not isinstance(path, str) or not path.startswith("/"):
            raise ConfigError(f"{key}: a path starting with '/', not {path!r}")
    if revoke == "engines" and engine == "sglang":
        raise ConfigError("revoke = 'engines' needs the engines' own revocation on wake (the example "
                          "engine's and vLLM's); SGLang engines: revoke = 'server'")
    config = CoordinatorConfig(
        lock=str(data.get("lock", "file:" + os.path.join(os.path.dirname(ranks[0]) or ".", "gms-serving.lock"))),
        initial=initial, ranks=ranks, sets=sets, failures=int(data.get("failures", 3)),
        events=data.get("events"), revoke=revoke, **paths, **{k: float(v) for k, v in fields.items()},
    )
    if config.failures < 1 or config.interval_s <= 0 or config.stall_s <= 0:
        raise ConfigError("failures must be >= 1, interval_s and stall_s > 0")
    return config


def load(path: str | os.PathLike) -> CoordinatorConfig:
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: {exc}") from None
    return parse(data)
