"""gms.integrations.sglang without a GPU or SGLang: the entry point, the
process's activation from SGLang's server args, the hook table, the memory
saver's release and resume on a real (host-backend) server, ``/gms/health``'s
answers; and, where SGLang is installed, every hook's target found in it.
The real engine runs in tests/test_sglang_gpu.py."""

from __future__ import annotations

import importlib
import importlib.util
import json
import pkgutil
import tomllib
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest

from gms.integrations.common import names
from gms.integrations.common.errors import ConfigError, MissingWorkerError
from gms.integrations.sglang import health, hooks, process

from .helpers import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
HAVE_SGLANG = importlib.util.find_spec("sglang") is not None


@pytest.fixture(autouse=True)
def fresh_process():
    process.deactivate()
    yield
    process.deactivate()


def server_args(load_format="gms", extra=None, saver=True):
    return SimpleNamespace(load_format=load_format, enable_memory_saver=saver,
                           model_loader_extra_config=json.dumps(extra) if extra is not None else "")


# -- registration ---------------------------------------------------------------------


def test_pyproject_registers_the_plugin_with_sglang():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"]["sglang.srt.plugins"] == {"gms": "gms.integrations.sglang:register"}
    assert any(req.startswith("sglang>=0.5.11") for req in project["optional-dependencies"]["sglang"])
    import gms.integrations.sglang as plugin  # without SGLang too: it imports SGLang only when called

    assert callable(plugin.register)
    # The installed gms (the README's editable install) carries it: SGLang's load_plugins() finds it so.
    found = {ep.name: ep.value for ep in metadata.entry_points(group="sglang.srt.plugins")}
    assert found.get("gms") == "gms.integrations.sglang:register"


def test_every_hook_names_a_dotted_target_a_kind_and_a_reason():
    kinds = {"before", "after", "around"}
    targets = [h.target for h in hooks.HOOKS]
    assert len(targets) == len(set(targets))
    for hook in hooks.HOOKS:
        assert hook.target.startswith("sglang.srt.") and hook.kind in kinds and hook.why and callable(hook.function)


@pytest.mark.skipif(not HAVE_SGLANG, reason="SGLang is not installed (pip install 'gms[sglang]')")
def test_every_hook_target_is_where_sglang_keeps_it():
    for hook in hooks.HOOKS:
        assert callable(pkgutil.resolve_name(hook.target)), hook.target
    import inspect

    from sglang.srt.managers.tokenizer_manager import TokenizerManager

    from gms.integrations.sglang import gate

    source = inspect.getsource(TokenizerManager)  # attributes made in __init__: found by their use
    assert all(f"self.{name}" in source for name in gate.USES)


# -- activation ---------------------------------------------------------------------------


def test_only_the_gms_load_format_activates():
    assert process.activate(server_args(load_format="auto")) is None and process.active() is None
    state = process.activate(server_args(extra={"gms_read_only": True, "gms_socket": "/run/x{device}.sock",
                                                "gms_exit_with_parent": False}), device=3)
    assert process.active() is state and state.memory_saver and state.config.read_only
    assert state.socket == "/run/x3.sock"
    launcher = process.activate(server_args(extra={"gms_exit_with_parent": False}))
    with pytest.raises(RuntimeError):
        launcher.socket  # noqa: B018 - the launcher has no GPU


def test_a_scheduler_knows_its_gpu_on_either_generation_of_sglang_s_api(monkeypatch):
    """Scheduler(server_args, port_args, gpu_id, ...) up to 0.5.17; 0.5.23's
    Scheduler(server_args, port_args) keeps the GPU in its runtime context."""
    import sys
    import types

    from gms.integrations.sglang import hooks

    args = server_args(extra={"gms_exit_with_parent": False})
    hooks.note_scheduler(None, args, "ports", 5, 0)
    assert process.active().device == 5
    hooks.note_scheduler(None, server_args=args, port_args="ports", gpu_id=6)
    assert process.active().device == 6
    context = types.ModuleType("sglang.srt.runtime_context")
    context.get_device = lambda: SimpleNamespace(gpu_id=7)
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", context)
    hooks.note_scheduler(None, args, "ports")
    assert process.active().device == 7


def test_a_rank_s_parallel_place_is_read_on_either_generation_of_sglang_s_api(monkeypatch):
    """0.5.23 no longer exports ``get_tensor_model_parallel_rank`` and the like from
    ``sglang.srt.distributed`` (the loader failed to import there): the rank's place is
    read from the runtime context where SGLang has one, from those getters before it."""
    import sys
    import types

    from gms.integrations.sglang import generations

    pipeline = SimpleNamespace(rank_in_group=0, world_size=1)
    for name in ("sglang", "sglang.srt", "sglang.srt.distributed"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    older = types.ModuleType("sglang.srt.distributed.parallel_state")
    older.get_tensor_model_parallel_rank = lambda: 1
    older.get_tensor_model_parallel_world_size = lambda: 2
    older.get_pp_group = lambda: pipeline
    monkeypatch.setitem(sys.modules, "sglang.srt.distributed.parallel_state", older)
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", None)  # (an import of it fails)
    assert generations.parallel_place() == ((1, 2), pipeline)
    context = types.ModuleType("sglang.srt.runtime_context")
    context.get_parallel = lambda: SimpleNamespace(tp_rank=3, tp_size=4, pp_group=pipeline)
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", context)
    assert generations.parallel_place() == ((3, 4), pipeline)


@pytest.mark.skipif(not HAVE_SGLANG, reason="SGLang is not installed (pip install 'gms[sglang]')")
def test_every_module_of_the_plugin_imports_with_the_sglang_installed():
    import gms.integrations.sglang as plugin

    for module in pkgutil.iter_modules(plugin.__path__):
        importlib.import_module(f"gms.integrations.sglang.{module.name}")


def test_a_wrong_key_fails_at_start_up():
    with pytest.raises(ConfigError, match="gms_read_onyl"):
        process.activate(server_args(extra={"gms_read_onyl": True}))
    with pytest.raises(ConfigError, match="not JSON"):
        process.activate(SimpleNamespace(load_format="gms", model_loader_extra_config="{nope"))
    assert process.active() is None


def test_the_memory_saver_is_gms_only_where_asked_for():
    pytest.importorskip("torch")
    from gms.integrations.sglang.saver import GMSMemorySaver, saver_for

    assert saver_for(True) is None  # not --load-format gms
    process.activate(server_args(saver=False, extra={"gms_exit_with_parent": False}))
    assert saver_for(True) is None  # --load-format gms without --enable-memory-saver
    process.activate(server_args(extra={"gms_exit_with_parent": False}))
    assert saver_for(False) is None  # SGLang asked for its no-op adapter
    mine = saver_for(True)
    assert isinstance(mine, GMSMemorySaver) and saver_for(True) is mine and mine.enabled
    assert hooks.memory_saver(lambda *a, **k: "sglang's", enable=True) is mine
    process.deactivate()
    assert hooks.memory_saver(lambda *a, **k: "sglang's", enable=True) == "sglang's"
    with mine.configure_subprocess():
        pass
    with pytest.raises(ValueError, match="gms knows"):
        mine.pause("activations")


def test_the_load_format_hook_leaves_other_formats_to_sglang():
    config = SimpleNamespace(load_format="safetensors")
    assert hooks.load_format_is_the_loader(lambda self: "checked", config) == "checked"
    assert config.load_format == "safetensors"


# -- the memory saver on a real server --------------------------------------------------------


def test_release_and_resume_through_the_saver(tmp_path):
    pytest.importorskip("torch")
    from gms.fsm import GrantedLockType
    from gms.integrations.common import memory
    from gms.integrations.common.config import EngineConfig
    from gms.integrations.sglang.saver import GMSMemorySaver, _scratch

    server = ServerProcess(tmp_path)
    ident = names.ModelIdentity(engine="sglang", engine_version="0.5.17", model="/m/llama", revision=None,
                                dtype="bfloat16", architecture="LlamaForCausalLM")
    saver = GMSMemorySaver()
    saved = memory._current
    try:
        memory._current = None
        with pytest.raises(MissingWorkerError):
            saver.pause("kv_cache")
        writer = memory.EngineMemory.open(EngineConfig(), server.socket, 0, names.weights_layout(ident),
                                          identity=ident)
        assert writer.connect_weights() is GrantedLockType.RW
        writer.weights.create_mapping(size=2 << 20, tag="weights")
        writer.weights.commit()
        engine = memory.EngineMemory.open(EngineConfig(read_only=True), server.socket, 0,
                                          names.weights_layout(ident), identity=ident)
        memory.install(engine)
        engine.connect_weights()
        engine.weights.create_mappings([h.allocation_id for h in engine.weights.list_handles()])
        kv, graph = _scratch(engine, "kv_cache"), _scratch(engine, "cuda_graph")
        kv_va, graph_va = kv.create_mapping(size=2 << 20, tag="kv_cache"), graph.create_mapping(size=2 << 20,
                                                                                                 tag="cuda_graph")
        assert kv.layout.startswith("sglang-kv/llama/") and graph.layout.startswith("sglang-graph/llama/")

        for tag in ("kv_cache", "weights", "cuda_graph"):  # SGLang's order
            saver.pause(tag)
        assert engine.asleep == {"kv_cache", "weights", "cuda_graph"}
        assert server.layout(kv.layout).state == "EMPTY" and server.layout(graph.layout).state == "EMPTY"
        assert server.layout(engine.weights.layout).readers == 0
        saver.pause("kv_cache")  # released already: nothing happens
        for tag in ("cuda_graph", "weights", "kv_cache"):
            saver.resume(tag)
        assert not engine.asleep
        assert [mp.va for mp in kv.mappings] == [kv_va] and [mp.va for mp in graph.mappings] == [graph_va]
        assert server.layout(engine.weights.layout).readers == 1 and server.layout(kv.layout).writer
        assert engine.weights.granted_lock_type is GrantedLockType.RO
        for m in (engine, writer):
            m.close()
    finally:
        memory._current = saved
        server.kill()


# -- /gms/health ----------------------------------------------------------------------------------


def test_health_says_asleep_between_a_release_and_a_resume():
    health._released.clear()
    assert health.status("Starting", False)[0] == 503 and health.status("Up", True)[0] == 503
    assert health.status("Up", False, 12.5, 3, 4242) == (
        200, {"status": "serving", "gms": {"released": []}, "progress": {"steps": 12500, "pending": 3}, "pid": 4242})
    health.note_released(health.tags(SimpleNamespace(tags=["kv_cache"])))
    assert health.status("Up", False)[1]["status"] == "asleep"
    health.note_released(health.tags(SimpleNamespace(tags=None)))  # None: every tag
    assert health.released() == {"weights", "kv_cache", "cuda_graph"}
    health.note_resumed(health.tags(SimpleNamespace(tags=None)))
    assert health.status("Up", False)[1]["status"] == "serving"


class FakeTokenizerManager:
    """The parts of SGLang 0.5.17's tokenizer manager the gate uses, with its
    ``generate_request``'s order: the pause gate, then ``model_update_lock`` as a
    reader for the request's life; and its scheduler's memory, mapped or not."""

    def __init__(self) -> None:
        import asyncio
        from contextlib import asynccontextmanager

        self.is_pause, self.is_pause_cond = False, asyncio.Condition()
        self.server_status = SimpleNamespace(name="Up")  # SGLang's ServerStatus enum
        self.mapped, self.ran = True, []
        cond, state = asyncio.Condition(), {"readers": 0, "writer": False}

        @asynccontextmanager
        async def reader():
            async with cond:
                await cond.wait_for(lambda: not state["writer"])
                state["readers"] += 1
            try:
                yield
            finally:
                async with cond:
                    state["readers"] -= 1
                    cond.notify_all()

        @asynccontextmanager
        async def writer():
            async with cond:
                await cond.wait_for(lambda: not state["writer"] and state["readers"] == 0)
                state["writer"] = True
            try:
                yield
            finally:
                async with cond:
                    state["writer"] = False
                    cond.notify_all()

        class RWLock:  # SGLang's aio_rwlock.RWLock: a fresh context manager per use
            reader_lock = property(lambda _: reader())
            writer_lock = property(lambda _: writer())

        self.model_update_lock = RWLock()

    async def generate(self, name: str, steps: int = 3) -> None:
        import asyncio

        async with self.is_pause_cond:
            await self.is_pause_cond.wait_for(lambda: not self.is_pause)
        async with self.model_update_lock.reader_lock:
            for _ in range(steps):  # a forward pass on unmapped memory is what kills SGLang's scheduler
                self.ran.append((name, self.mapped))
                await asyncio.sleep(0)

    @staticmethod
    async def sglang_release(self, obj, request=None):
        self.mapped = False

    @staticmethod
    async def sglang_resume(self, obj, request=None):
        self.mapped = True


def test_a_released_engine_holds_its_requests_until_the_resume():
    """Found on the H100: a request that reached a released SGLang engine killed its
    scheduler.  The release waits for the request in flight, later ones wait for the resume."""
    import asyncio

    from gms.integrations.sglang import gate

    async def scenario():
        health._released.clear()
        m = FakeTokenizerManager()
        kv, everything = SimpleNamespace(tags=["kv_cache"]), SimpleNamespace(tags=None)
        first = asyncio.create_task(m.generate("in flight"))
        await asyncio.sleep(0)  # past the gate, holding the reader lock
        await gate.release(m.sglang_release, m, kv)
        assert first.done() and not m.mapped  # drained before SGLang released
        later = asyncio.create_task(m.generate("sent while released"))
        await gate.release(m.sglang_release, m, everything)  # a second release: still held
        for _ in range(20):
            await asyncio.sleep(0)
        assert not later.done() and health.status("Up", False)[1]["status"] == "asleep"
        await gate.resume(m.sglang_resume, m, kv)  # weights and graphs still released: held
        for _ in range(20):
            await asyncio.sleep(0)
        assert not later.done()
        await gate.resume(m.sglang_resume, m, everything)
        await asyncio.wait_for(later, 5)
        assert m.ran and all(mapped for _, mapped in m.ran), m.ran  # nothing ran on released memory
        assert not m.is_pause

        async with m.is_pause_cond:  # a user's /pause_generation: the resume leaves it shut
            m.is_pause = True
        await gate.release(m.sglang_release, m, everything)
        await gate.resume(m.sglang_resume, m, everything)
        assert m.is_pause

        async def failing_release(self, obj, request=None):
            raise RuntimeError("the scheduler said no")

        m.is_pause = False
        with pytest.raises(RuntimeError):
            await gate.release(failing_release, m, everything)
        assert not m.is_pause and not health.released()  # nothing released: requests go on

        m.server_status = SimpleNamespace(name="Starting")  # /v1/models answers, the warm-up has yet to run
        early = asyncio.create_task(gate.release(m.sglang_release, m, everything))
        await asyncio.sleep(3 * gate.STARTING_POLL_S)
        assert not early.done() and m.mapped and not m.is_pause  # the gate open for SGLang's warm-up
        await asyncio.wait_for(m.generate("SGLang's warm-up"), 5)
        m.server_status = SimpleNamespace(name="Up")
        await asyncio.wait_for(early, 5)
        assert not m.mapped and m.is_pause
        await gate.resume(m.sglang_resume, m, everything)

    asyncio.run(scenario())


def test_the_coordinator_s_first_token_is_a_prompt_sglang_accepts():
    """SGLang's /v1/completions refuses a prompt of falsy token ids as empty (400),
    so the canary's one token is not 0: found on the H100, where the shadow woke
    in 16 ms and every first-token request came back 400."""
    from gms.failover.probes import CANARY_PROMPT

    assert CANARY_PROMPT and any(CANARY_PROMPT)
    if HAVE_SGLANG:
        from sglang.srt.entrypoints.openai.protocol import CompletionRequest
        from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion

        request = CompletionRequest(prompt=CANARY_PROMPT, max_tokens=1)
        assert OpenAIServingCompletion._validate_request(None, request) is None
