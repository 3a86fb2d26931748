"""gms.integrations.vllm without a GPU: configuration, layout names, the plugin's
registration, the two layouts' sleep and wake on a real (host-backend) server,
exit with the parent; and, where vLLM is installed, vLLM finding the plugin and
the loader's read-only import against vLLM's own Llama (tests/vllm_cpu_probe.py).
The real engine runs in tests/test_vllm_gpu.py."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from importlib import metadata
from pathlib import Path

import pytest

from gms.fsm.sessions import validate_layout_name
from gms.integrations.common import config, names
from gms.integrations.common.errors import ConfigError, LayoutMismatchError, MissingWorkerError

from .helpers import ServerProcess, wait_until

ROOT = Path(__file__).resolve().parent.parent
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install 'gms[vllm]')")


# -- configuration ------------------------------------------------------------------


def test_extra_config_defaults_and_pass_through():
    gms, rest = config.parse({"num_threads": 4, "enable_multithread_load": True})
    assert gms == config.EngineConfig()
    assert (gms.read_only, gms.load_format, gms.residency, gms.exit_with_parent) == (False, "auto", "device", True)
    assert gms.lock_timeout_ms is None and gms.socket_for(3) is None
    assert rest == {"num_threads": 4, "enable_multithread_load": True}  # vLLM's own loader gets these
    assert config.parse(None) == (config.EngineConfig(), {})


def test_extra_config_reads_every_key():
    gms, rest = config.parse({
        "gms_read_only": True, "gms_socket": "/run/gms/gpu{device}.sock", "gms_layout": "llama-8b",
        "gms_kv_layout": "kv-a", "gms_lock_timeout_s": 2.5, "gms_load_format": "SafeTensors",
        "gms_residency": "system", "gms_exit_with_parent": False,
    })
    assert rest == {}
    assert gms.read_only and not gms.exit_with_parent
    assert (gms.layout, gms.kv_layout, gms.load_format, gms.residency) == ("llama-8b", "kv-a", "safetensors", "system")
    assert gms.lock_timeout_ms == 2500
    assert gms.socket_for(1) == "/run/gms/gpu1.sock"


@pytest.mark.parametrize("extra", [
    {"gms_read_onyl": True},                 # a typo is an error, not the default
    {"gms_read_only": "true"},               # JSON booleans only
    {"gms_read_only": 1},
    {"gms_lock_timeout_s": -1},
    {"gms_lock_timeout_s": True},
    {"gms_socket": ""},
    {"gms_load_format": "gms"},              # the disk format cannot be gms itself
    {"gms_residency": "gpu"},
    {"gms_exit_with_parent": None},
])
def test_extra_config_refuses(extra):
    with pytest.raises(ConfigError):
        config.parse(extra)
    with pytest.raises(ConfigError):
        config.parse(["gms_read_only"])


# -- layout names ----------------------------------------------------------------------


def identity(**changes) -> names.ModelIdentity:
    fields = dict(engine="vllm", engine_version="0.26.0", model="/models/meta-llama/Llama-3.1-8B-Instruct",
                  revision=None, dtype="bfloat16", architecture="LlamaForCausalLM")
    return names.ModelIdentity(**{**fields, **changes})


def test_weights_layout_is_per_model_and_per_rank():
    one = names.weights_layout(identity())
    assert one.startswith("vllm/Llama-3.1-8B-Instruct/bfloat16/") and one.count("/") == 3
    assert names.weights_layout(identity()) == one  # the same model: the same layout, in any process
    others = {names.weights_layout(identity(**c)) for c in (
        {"model": "/models/Qwen3-8B"}, {"dtype": "float16"}, {"revision": "r2"}, {"engine_version": "0.27.0"}, {"engine": "sglang"},
        {"architecture": "MistralForCausalLM"}, {"tp_size": 2}, {"pp_size": 2})}
    assert len(others) == 8 and one not in others
    ranks = [names.weights_layout(identity(tp_rank=r, tp_size=2)) for r in range(2)]
    assert ranks[0].endswith("/tp0of2") and ranks[1].endswith("/tp1of2")
    assert ranks[0].rsplit("/", 1)[0] == ranks[1].rsplit("/", 1)[0]  # one model: one digest for every rank
    assert names.weights_layout(identity(tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)).endswith("/tp1of2/pp1of2")
    for name in (one, *ranks):
        assert validate_layout_name(name) == name  # the server's own check


def test_kv_layout_is_per_engine():
    a, b = (names.scratch_layout(identity(), "kv_cache", pid) for pid in (100, 200))
    assert a != b and a.startswith("vllm-kv/Llama-3.1-8B-Instruct/") and a.endswith("/tp0of1/pid100")
    assert names.scratch_layout(identity(tp_rank=1, tp_size=4), "kv_cache", 7).endswith("/tp1of4/pid7")
    validate_layout_name(a)


def test_layout_names_hold_any_model_name():
    long = identity(model="/m/" + "x" * 300, tp_rank=7, tp_size=8, pp_rank=3, pp_size=4)
    for name in (names.weights_layout(long), names.scratch_layout(long, "cuda_graph", 4194304)):
        assert len(name.encode()) <= names.MAX_LAYOUT_BYTES
        validate_layout_name(name)
    odd = identity(model="hub user/Model (v2)!")
    assert names.weights_layout(odd).startswith("vllm/Model-v2/")
    assert identity(model="///").slug == "model"


def test_layout_overrides_keep_the_rank_suffix():
    assert names.weights_layout(identity(), "llama") == "llama"
    assert names.weights_layout(identity(tp_rank=1, tp_size=2), "llama") == "llama/tp1of2"
    assert names.scratch_layout(identity(tp_rank=1, tp_size=2), "kv_cache", 5, "kv-a") == "kv-a/tp1of2"
    for bad in ("-starts-badly", "has space", "é", "x" * 200):
        with pytest.raises(ConfigError):
            names.weights_layout(identity(), bad)


def test_identity_round_trips_and_names_its_differences():
    mine = identity(tp_rank=1, tp_size=2)
    assert names.ModelIdentity.from_json(mine.to_json()) == mine
    assert mine.differences(mine) == []
    other = identity(tp_rank=0, tp_size=2, dtype="float16")
    assert [d.split(":")[0] for d in mine.differences(other)] == ["dtype", "tp_rank"]
    with pytest.raises(ValueError):
        identity(tp_rank=2, tp_size=2)


# -- registration -----------------------------------------------------------------------

ENTRY_POINTS = {
    "vllm.general_plugins": ("gms", "gms.integrations.vllm:register"),
    "vllm.endpoint_plugins": ("gms", "gms.integrations.vllm.endpoints:GmsEndpoints"),
}


def test_pyproject_registers_the_plugins_with_vllm():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for group, (name, target) in ENTRY_POINTS.items():
        assert project["entry-points"][group] == {name: target}
        module, _, attr = target.partition(":")
        assert importlib.util.find_spec(module) is not None, module
    assert any(req.startswith("vllm>=0.26") for req in project["optional-dependencies"]["vllm"])
    import gms.integrations.vllm as plugin  # without vLLM too: it imports vLLM only when called

    assert callable(plugin.register)


def test_installed_metadata_carries_the_entry_points():
    dist = metadata.distribution("gms")
    origin = json.loads(dist.read_text("direct_url.json") or "{}").get("url", "")
    # An editable install leaves its metadata in this checkout (gms.egg-info) or
    # records the checkout in direct_url.json; any other gms is not this code's.
    if origin.removeprefix("file://") != str(ROOT) and Path(dist.locate_file("")).resolve() != ROOT:
        pytest.skip(f"the installed gms comes from {origin or dist.locate_file('')}, not this checkout")
    for group, (name, target) in ENTRY_POINTS.items():
        found = {ep.name: ep.value for ep in metadata.entry_points(group=group)}
        assert found.get(name) == target


# -- the two layouts on a real server -----------------------------------------------------


def engine_memory(server, ident, pid, **options):
    from gms.integrations.common.memory import KV_CACHE, EngineMemory

    gms_config = config.EngineConfig(**options)
    return EngineMemory.open(gms_config, server.socket, 0, names.weights_layout(ident),
                             {KV_CACHE: names.scratch_layout(ident, KV_CACHE, pid)}, ident)


def test_first_engine_writes_later_ones_read_and_sleep_releases(tmp_path):
    pytest.importorskip("torch")
    from gms.fsm import GrantedLockType, RequestedLockType

    server = ServerProcess(tmp_path)
    try:
        ident = identity()
        first, second = engine_memory(server, ident, 1), engine_memory(server, ident, 2)
        assert first.connect() is GrantedLockType.RW and first.writer
        weights_va = first.weights.create_mapping(size=4 << 20, tag="weights")
        first.weights.write(weights_va, b"published")
        first.weights.metadata_put(names.identity_key("vllm"), first.weights.mappings[0].allocation_id, 0,
                                   ident.to_json())
        first.weights.commit()
        first.weights.connect(RequestedLockType.RO)
        first.weights.remap_all_vas()  # the writer reads its own weights, as the loader leaves it
        assert second.connect() is GrantedLockType.RO and not second.writer
        kv_va = second.kv.create_mapping(size=2 << 20, tag="kv_cache")
        second.weights.create_mappings([first.weights.mappings[0].allocation_id])
        kv_name = second.kv.layout
        assert server.layout(kv_name).writer and kv_name != first.kv.layout

        second.sleep()
        assert second.asleep == {"weights", "kv_cache"}
        assert server.layout(kv_name).state == "EMPTY"  # the KV layout went with its lock
        assert server.layout(first.weights.layout).readers == 1
        assert not any(mp.mapped for mp in second.weights.mappings + second.kv.mappings)
        second.sleep()  # asleep already: nothing happens

        second.wake(["weights"])
        assert second.asleep == {"kv_cache"}
        assert second.weights.read(second.weights.mappings[0].va, 9) == b"published"
        second.wake()
        assert not second.asleep and [mp.va for mp in second.kv.mappings] == [kv_va]  # same address
        assert server.layout(kv_name).writer and server.layout(kv_name).allocation_count == 1
        for m in (first, second):
            m.close()
    finally:
        server.kill()


def test_an_engine_released_after_its_server_was_killed_frees_its_memory_and_wakes_on_the_next(tmp_path):
    """The daemon SIGKILLed under a serving engine: the engine's tensors go on
    (nothing calls the server while it serves); its next release must still
    unmap everything, though the kernel says both connections are gone, and
    its resume must find the restarted server (weights: the same layout, kept
    by the keeper; KV: fresh memory at the same addresses)."""
    pytest.importorskip("torch")
    from gms.fsm import GrantedLockType

    from .test_restart import killed

    server = ServerProcess(tmp_path, keeper=True)
    try:
        ident = identity()
        writer, engine = engine_memory(server, ident, 1), engine_memory(server, ident, 2, read_only=True)
        writer.connect_weights()
        writer.weights.write(writer.weights.create_mapping(size=4 << 20, tag="weights"), b"published")
        writer.weights.commit()
        engine.connect()
        engine.weights.create_mappings([h.allocation_id for h in engine.weights.list_handles()])
        kv_va = engine.kv.create_mapping(size=2 << 20, tag="kv_cache")
        weights_hash = server.layout(engine.weights.layout).memory_layout_hash

        killed(server)
        assert not engine.weights.is_connected and not engine.kv.is_connected
        assert engine.weights.read(engine.weights.mappings[0].va, 9) == b"published"  # serving on

        engine.sleep()
        assert engine.asleep == {"weights", "kv_cache"}
        assert not any(mp.mapped for mp in engine.weights.mappings + engine.kv.mappings)
        engine.wake()
        assert not engine.asleep and engine.weights.granted_lock_type is GrantedLockType.RO
        assert engine.weights.read(engine.weights.mappings[0].va, 9) == b"published"
        assert server.layout(engine.weights.layout).memory_layout_hash == weights_hash
        assert [mp.va for mp in engine.kv.mappings] == [kv_va] and server.layout(engine.kv.layout).writer
        for m in (engine, writer):
            m.close()
    finally:
        server.kill()


def test_read_only_waits_for_a_commit_and_a_republished_layout_fails_the_wake(tmp_path):
    pytest.importorskip("torch")
    from gms import LockTimeoutError
    from gms.fsm import RequestedLockType

    server = ServerProcess(tmp_path)
    try:
        ident = identity()
        reader = engine_memory(server, ident, 3, read_only=True, lock_timeout_s=0.2)
        with pytest.raises(LockTimeoutError):  # RO never builds the layout: it waits for a writer's
            reader.connect()
        writer = engine_memory(server, ident, 4)
        writer.connect()
        writer.weights.create_mapping(size=2 << 20, tag="weights")
        writer.weights.commit()
        reader.connect()
        reader.weights.create_mappings([h.allocation_id for h in reader.weights.list_handles()])
        reader.sleep()
        again = engine_memory(server, ident, 5)  # somebody publishes the layout anew meanwhile
        again.weights.connect(RequestedLockType.RW)
        again.weights.create_mapping(size=4 << 20, tag="weights")
        again.weights.commit()
        with pytest.raises(LayoutMismatchError):
            reader.wake()
        assert "weights" in reader.asleep and not reader.weights.is_connected
        for m in (reader, writer, again):
            m.close()
    finally:
        server.kill()


def test_loader_without_the_worker_says_what_to_add():
    pytest.importorskip("torch")
    from gms.integrations.common import memory as common
    from gms.integrations.vllm import memory

    saved, common._current = common._current, None
    try:
        with pytest.raises(MissingWorkerError, match="--worker-cls gms.integrations.vllm.worker.GMSWorker"):
            memory.current()
    finally:
        common._current = saved


# -- exit with the parent ------------------------------------------------------------------

CHILD = """
import sys, time
from gms.integrations.common.parent import exit_with_parent
print("watching" if exit_with_parent() else "not watching", flush=True)
time.sleep(120)
"""
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=sys.stdout)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_worker_exits_when_its_parent_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        child = int(parent.stdout.readline())
        assert parent.stdout.readline().strip() == "watching"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        started = time.monotonic()
        wait_until(lambda: not _alive(child), timeout=10, what="the child's exit")
        assert time.monotonic() - started < 5
    finally:
        if parent.poll() is None:
            parent.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


# -- with vLLM installed --------------------------------------------------------------------


@needs_vllm
def test_vllm_finds_the_plugin(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "gms")
    code = """
import json
from vllm.plugins import load_general_plugins, load_endpoint_plugins
load_general_plugins()
from vllm.config.load import LoadConfig
from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
from vllm.model_executor.model_loader import get_model_loader
loader = get_model_loader(LoadConfig(load_format="gms", model_loader_extra_config={"gms_read_only": True}))
print(json.dumps({
    "loader": type(loader).__module__ + "." + type(loader).__name__,
    "read_only": loader.gms.read_only,
    "sleep": SleepModeBackendFactory.get_backend_class("gms").__name__,
    "endpoints": [type(p).__name__ for p in load_endpoint_plugins(("generate",))],
}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found == {"loader": "gms.integrations.vllm.loader.GMSModelLoader", "read_only": True,
                     "sleep": "GMSSleepBackend", "endpoints": ["GmsEndpoints"]}


@needs_vllm
def test_read_only_import_equals_vllms_own_load(tmp_path):
    pytest.importorskip("torch")
    from .engine_helpers import make_tiny_model

    model = make_tiny_model(tmp_path / "model")
    server = ServerProcess(tmp_path)
    try:
        out = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_cpu_probe.py"), str(model), server.socket],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 0, out.stderr[-3000:]
        found = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        server.kill()
    assert found["granted"] == "RO" and found["names"] and found["unequal"] == []
    assert found["params"] > 0 and found["params_in_gms"] == found["params"]
    assert "dtype: 'float32', this engine 'bfloat16'" in found["refused"]


@needs_vllm
def test_the_bench_command_lines_parse(tmp_path):
    """bench/vllm.py's, bench/vllm_daemons.py's and tests/test_vllm_gpu.py's ``vllm serve`` (and
    ``vllm preload``) lines, through vLLM's parser."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import vllm_daemons
        from vllm_engines import serve_argv
        from vllm_model import make_model
    finally:
        sys.path.remove(str(ROOT / "bench"))
    model = make_model(tmp_path / "model", "tiny", "float32")["folder"]
    lines = {
        "gms": serve_argv(model, 8001, extra={"gms_socket": "/tmp/x.sock", "gms_read_only": True}),
        "baseline": serve_argv(model, 8002, load_format="safetensors", sleep_mode=True, kv_bytes=1 << 30),
    }
    if _has_preload():  # vLLM's weight daemon (0.33 on): bench/vllm_daemons.py's lines too
        lines["ipc_cache"] = serve_argv(model, 8003, load_format="ipc_cache", extra={"socket_dir": "/tmp/ipc"})
    for what, argv in lines.items():
        found = _probe("--argv", argv[argv.index("serve") + 1:], what)
        if what == "gms":
            assert found["load_format"] == "gms" and found["worker_cls"] == "gms.integrations.vllm.worker.GMSWorker"
            assert found["extra"] == {"gms_socket": "/tmp/x.sock", "gms_read_only": True}
        elif what == "ipc_cache":
            assert found["load_format"] == "ipc_cache" and found["extra"] == {"socket_dir": "/tmp/ipc"}
        else:
            assert found["load_format"] == "safetensors" and found["sleep_mode"] and found["kv_bytes"] == 1 << 30
    if _has_preload():
        argv = vllm_daemons.preload_argv(model, "/tmp/ipc", 18439, max_model_len=512, eager=True)
        found = _probe("--preload-argv", argv[argv.index("preload") + 1:], "preload")
        assert found == {"model": model, "load_format": "auto", "socket_dir": "/tmp/ipc", "health_port": 18439}


def _has_preload() -> bool:
    return importlib.util.find_spec("vllm.entrypoints.cli.preload") is not None


def _probe(flag: str, argv: list[str], what: str) -> dict:
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "vllm_cpu_probe.py"), flag, json.dumps(argv)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, f"{what}: {out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- every release in the range (tests/data/vllm_surface, scripts/vllm_surface.py) ----------------

SURFACES = ROOT / "tests" / "data" / "vllm_surface"


@pytest.mark.parametrize("release", __import__("gms.integrations.vllm.surface", fromlist=["RELEASES"]).RELEASES)
def test_the_plugin_finds_what_it_uses_in_every_release_of_its_range(release):
    from gms.integrations.vllm import surface

    kept = json.loads((SURFACES / f"{release}.json").read_text())
    assert kept["vllm"] == release
    # The kept surface answers for every use the plugin has now (else: run scripts/vllm_surface.py again).
    assert set(kept["uses"]) == {use.key for use in surface.USES}, "re-read the wheels: scripts/vllm_surface.py"
    assert surface.check(kept["uses"]) == []


def test_the_extra_s_range_is_exactly_the_releases_checked():
    from gms.integrations.vllm import surface

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    assert f"vllm>={surface.RELEASES[0]},<={surface.RELEASES[-1]}" in extra
    assert sorted(p.stem for p in SURFACES.glob("*.json")) == sorted(surface.RELEASES)


def test_the_release_check_names_what_moved():
    from gms.integrations.vllm.surface import USES, Use, check, problems

    call = Use("m", "f", "call", positional=2, keywords=("device",))
    assert problems(call, None) == ["m:f: not found"]
    assert problems(call, {"params": [["a", "either", False], ["b", "either", False], ["device", "keyword", True]]}) == []
    assert "takes 1 positional" in problems(call, {"params": [["a", "either", False], ["device", "keyword", True]]})[0]
    assert "no parameter 'device'" in problems(call, {"params": [["a", "either", False], ["b", "either", False]]})[0]
    assert "requires c" in problems(call, {"params": [["a", "either", False], ["b", "either", False],
                                                      ["c", "keyword", False], ["device", "keyword", True]]})[0]
    override = Use("m", "C.g", "override", params=("tag",))
    assert "parameters are ('tag', 'stream')" in problems(override, {"params": [["tag", "either", False],
                                                                                ["stream", "either", True]]})[0]
    subclass = Use("m", "C", "subclass", defines=("g",))
    assert "abstract h" in problems(subclass, {"abstract": ["g", "h"]})[0]
    assert "is 'x'" in problems(Use("m", "K", "constant", value="y"), {"value": "x"})[0]
    assert len(check({})) == len(USES)  # an empty release lacks everything


def test_every_name_the_plugin_imports_from_vllm_is_in_the_table():
    import ast

    from gms.integrations.vllm.surface import USES

    listed = {(use.module, use.name.split(".")[0]) for use in USES}
    imported = set()
    for path in (ROOT / "gms" / "integrations" / "vllm").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm" and not node.level:
                imported |= {(node.module, alias.name) for alias in node.names}
    assert imported and imported <= listed, sorted(imported - listed)


def test_progress_comes_from_vllm_s_own_metrics():
    from prometheus_client import CollectorRegistry, Counter, Gauge

    from gms.integrations.vllm.progress import TOKEN_WEIGHT, progress

    registry = CollectorRegistry()
    assert progress(registry) is None  # --disable-log-stats: nothing to go by
    labels = ["model_name", "engine"]
    prompt = Counter("vllm:prompt_tokens", "", labels, registry=registry)
    generated = Counter("vllm:generation_tokens", "", labels, registry=registry)
    running = Gauge("vllm:num_requests_running", "", labels, registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "", labels, registry=registry)
    assert progress(registry) == {"steps": 0, "pending": 0}
    for engine in ("0", "1"):  # data parallel: every engine's counts
        prompt.labels("m", engine).inc(12)
        generated.labels("m", engine).inc(3)
        running.labels("m", engine).set(2)
        waiting.labels("m", engine).set(1)
    assert progress(registry) == {"steps": 30 * TOKEN_WEIGHT, "pending": 6}
    # A long prompt prefilled in chunks: no token yet, but each chunk takes KV blocks.
    usage = Gauge("vllm:kv_cache_usage_perc", "", labels, registry=registry)
    before = progress(registry)["steps"]
    usage.labels("m", "0").set(0.25)
    moved = progress(registry)["steps"]
    usage.labels("m", "0").set(0.2513)
    assert before < moved < progress(registry)["steps"] and progress(registry)["pending"] == 6
    prompt.labels("m", "0").inc(1)  # tokens and usage never mistaken for each other
    usage.labels("m", "0").set(0.0)
    assert progress(registry)["steps"] == 31 * TOKEN_WEIGHT


def test_gms_health_answers_from_progress_while_work_is_pending_and_sees_a_core_hung_while_idle():
    import asyncio

    from prometheus_client import CollectorRegistry, Counter, Gauge

    from gms.integrations.vllm.progress import TOKEN_WEIGHT, Health

    registry = CollectorRegistry()
    tokens = Counter("vllm:generation_tokens", "", registry=registry)
    Counter("vllm:prompt_tokens", "", registry=registry)
    running = Gauge("vllm:num_requests_running", "", registry=registry)
    Gauge("vllm:num_requests_waiting", "", registry=registry)

    class Client:
        def __init__(self, sleeping=False, hang=False, dead=False):
            self.sleeping, self.hang, self.dead, self.calls = sleeping, hang, dead, []

        async def check_health(self):
            if self.dead:
                raise RuntimeError("engine core died")

        async def is_sleeping(self):
            self.calls.append("is_sleeping")
            if self.hang:
                await asyncio.Event().wait()  # a stopped engine core never answers
            return self.sleeping

    async def canary():
        tokens.inc()

    async def broken():
        raise RuntimeError("CUDA error")

    async def scenario():
        health = Health(registry, answer_within=0.05)
        assert (await health.answer(None, canary, 1))[0] == 503
        assert (await health.answer(Client(dead=True), canary, 1))[1]["status"] == "dead"
        code, body = await health.answer(Client(), canary, 1)  # idle and awake: one token
        assert code == 200 and body["status"] == "serving" and body["progress"] == {"steps": TOKEN_WEIGHT, "pending": 0}
        assert (await health.answer(Client(sleeping=True), canary, 1))[1]["status"] == "asleep"
        assert (await health.answer(Client(), broken, 1))[0] == 503
        assert (await health.answer(Client(sleeping=True), canary, 1))[1]["status"] == "asleep"
        running.set(3)  # saturated (or just woken): answered from its progress, the core not asked at all
        busy = Client()
        code, body = await health.answer(busy, canary, 1)
        assert (code, body["status"], body["progress"], busy.calls) == (
            200, "serving", {"steps": TOKEN_WEIGHT, "pending": 3}, [])
        running.set(0)
        assert (await health.answer(Client(), canary, 1))[1]["status"] == "serving"  # what the core last said
        hung = Client(hang=True)  # the core hangs while idle: the answer comes from the progress...
        code, body = await health.answer(hung, canary, 1)
        assert (code, body["status"], body["progress"]) == (200, "serving", {"steps": 2 * TOKEN_WEIGHT, "pending": 1})
        code, body = await health.answer(hung, canary, 1)  # ...and the next at once, the core not asked again
        assert (code, body["progress"]) == (200, {"steps": 2 * TOKEN_WEIGHT, "pending": 1}) and hung.calls == ["is_sleeping"]

    asyncio.run(scenario())


def test_a_rank_s_identity_names_a_local_model_by_its_real_folder(tmp_path):
    from types import SimpleNamespace

    pytest.importorskip("torch")  # gms.integrations.common.weights works on torch modules

    from gms.integrations.common.weights import identity

    (tmp_path / "model").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "model")
    pp = SimpleNamespace(rank_in_group=1, world_size=2)
    one, other = (identity("sglang", "0.5.17", str(tmp_path / name), None, "torch.bfloat16", "LlamaForCausalLM",
                           (0, 2), pp) for name in ("model", "link"))
    assert one == other and one.model == str((tmp_path / "model").resolve())
    assert (one.dtype, one.tp_rank, one.tp_size, one.pp_rank, one.pp_size) == ("bfloat16", 0, 2, 1, 2)
    hub = identity("vllm", "0.26.0", "meta-llama/Llama-3.1-8B", "r1", "float16", "LlamaForCausalLM", (0, 1),
                   SimpleNamespace(rank_in_group=0, world_size=1))
    assert hub.model == "meta-llama/Llama-3.1-8B"  # a hub id stays as given
