"""vLLM after a reboot (issue 52): a real engine imports weights the disk tier kept.

The operator's configuration: a policy whose tenant persists its commits, and
gms under its keeper.  Engine A (``--load-format gms``) loads the checkpoint
and publishes; the server saves the weights' snapshot.  Then a reboot, as the
disk tier's host tests simulate it: every gms process stopped and the engine
gone, the checkpoint's weight files deleted (what an engine still reads from
its folder is its config and tokenizer), and ``gms serve`` again on the same
folders.  Engine B, with the default loader config (``RW_OR_RO``), is granted
RO, waits while the server restores the layout from disk, imports it, and
answers exactly what engine A answered.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from .test_disk_tier import _no_server_outlives_its_test, saved  # noqa: F401 (the fixture: every server killed)
from .test_disk_tier import serve as serve_on
from .test_vllm_gpu import PROMPT, TOKENS, GiB, _bench

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


def test_an_engine_imports_weights_restored_from_disk_after_a_reboot(tmp_path):
    engines, model_mod = _bench()
    model = model_mod.make_model(tmp_path / "model", "tiny", "bfloat16")["folder"]
    policy = tmp_path / "policy.toml"
    policy.write_text(f'[[tenant]]\nname = "inference"\nuids = [{os.getuid()}]\nwrite = ["*"]\npersist = true\n')
    env = engines.serve_env(str(tmp_path / "vllm-cache"))

    def engine(name: str, port: int, socket: str):
        argv = engines.serve_argv(model, port, kv_bytes=GiB // 2, gpu_utilization=0.1, max_model_len=512,
                                  max_num_seqs=4, extra={"gms_socket": socket})
        started = engines.Engine(argv, env, tmp_path / f"{name}.log", port)
        try:
            started.wait_ready(900)
        except BaseException:
            started.stop()
            raise
        return started

    server = serve_on(tmp_path, "--policy", str(policy), backend="cuda")
    a = engine("A", 18311, server.socket)
    try:
        assert a.load_line()["gms_how"] == "loaded from disk and published"
        expected = a.complete(PROMPT, TOKENS)["token_ids"]
        weights = next(row.name for row in server.state().layouts if row.name.startswith("vllm/model/"))
        saved(server, weights)
    finally:
        a.stop()
    assert server.stop() == 0  # the keeper and every gms process: a reboot
    for file in Path(model).glob("*.safetensors"):
        file.unlink()  # from here the weights exist only in gms's snapshot

    server = serve_on(tmp_path, "--policy", str(policy), socket_path=server.socket, backend="cuda")
    row = server.layout(weights)
    assert (row.state, row.tier) == ("COMMITTED", "disk"), server.log
    b = engine("B", 18312, server.socket)
    try:
        assert b.load_line()["gms_how"] == "imported"
        assert b.complete(PROMPT, TOKENS)["token_ids"] == expected
        assert (server.layout(weights).tier, server.layout(weights).restores) == ("device", 1)
    finally:
        b.stop()
    server.stop()
