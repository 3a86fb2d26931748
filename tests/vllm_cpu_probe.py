"""The gms loader's read-only import against vLLM's real model classes, without a GPU.

Run by tests/test_vllm.py in a process of its own (it changes vLLM's global
state): ``python tests/vllm_cpu_probe.py MODEL_DIR SOCKET``, where SOCKET is a
host-backend gms server.  Prints one JSON line.  ``python
tests/vllm_cpu_probe.py --argv JSON`` instead parses a ``vllm serve`` command
line (JSON list, after ``serve``) as vLLM does and builds its engine config;
``--preload-argv JSON`` a ``vllm preload`` line (the weight daemon of vLLM 0.33).

vLLM's CUDA wheel has no CPU kernels and picks no platform on a machine
without a GPU, so this probe (test scaffolding, nothing more) sets vLLM's
CPU platform and defines the few ``_C`` operators that building a Llama looks
up; no forward pass runs.  Then:

1. vLLM's default loader reads the checkpoint (the reference);
2. its tensors are published to gms as the writer's path leaves them (every
   parameter and buffer under ``names.tensor_prefix("vllm")``, plus the identity);
3. ``GMSModelLoader`` (``--load-format gms``), with the worker's
   ``EngineMemory`` connected ``RW_OR_RO`` and so granted ``RO``, builds the
   model with its parameters on ``meta`` and maps the published tensors;
   ``process_weights_after_loading`` runs over the read-only mappings;
4. every tensor of the state dict must equal the reference's, parameters
   must lie in gms memory, and a reader with another identity is refused.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import vllm.platforms
from vllm.platforms.cpu import CpuPlatform

vllm.platforms._current_platform = CpuPlatform()

_lib = torch.library.Library("_C", "FRAGMENT")
for _schema in (
    "silu_and_mul(Tensor! out, Tensor input) -> ()",
    "rms_norm(Tensor! out, Tensor input, Tensor weight, float epsilon) -> ()",
    "fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor weight, float epsilon) -> ()",
    "rotary_embedding(Tensor positions, Tensor! query, Tensor!? key, int head_size, Tensor cos_sin_cache, "
    "bool is_neox) -> ()",
):
    try:
        _lib.define(_schema)
    except RuntimeError:  # defined already (a CPU build of vLLM)
        pass

from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.model_executor.model_loader import get_model_loader  # noqa: E402

import gms.torch  # noqa: E402
from gms import GMSClientMemoryManager, RequestedLockType  # noqa: E402
from gms.integrations.common import memory, names  # noqa: E402
from gms.integrations.common.config import EngineConfig  # noqa: E402
from gms.integrations.common.errors import LayoutMismatchError  # noqa: E402
from gms.integrations.vllm import register  # noqa: E402


def engine_config(model: str, load_format: str):
    return EngineArgs(model=model, load_format=load_format, dtype="float32", enforce_eager=True,
                      max_model_len=128).create_engine_config()


def parse_serve(argv: list[str]) -> dict:
    """A ``vllm serve`` command line through vLLM's own parser and config checks."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:  # vLLM 0.33 moved the serve parser from openai/ to common/
        from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args

    # The CPU platform has no sleep mode; a GPU has: let the CPU say yes, for the checks alone.
    CpuPlatform.is_sleep_mode_available = classmethod(lambda cls: True)
    CpuPlatform.is_cumem_allocator_available = classmethod(lambda cls: True)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    args.model = args.model_tag or args.model  # as `vllm serve` does (vllm/entrypoints/cli/serve.py)
    validate_parsed_serve_args(args)
    engine = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    return {"load_format": engine.load_config.load_format, "worker_cls": engine.parallel_config.worker_cls,
            "extra": engine.load_config.model_loader_extra_config,
            "kv_bytes": engine.cache_config.kv_cache_memory_bytes,
            "sleep_mode": engine.model_config.enable_sleep_mode}


def parse_preload(argv: list[str]) -> dict:
    """A ``vllm preload`` command line (vLLM's weight daemon, 0.33 on) through its own parser."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.preload import PreloadSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    PreloadSubcommand.add_cli_args(parser)
    args = parser.parse_args(argv)
    engine = EngineArgs.from_cli_args(args).create_engine_config()
    return {"model": engine.model_config.model, "load_format": engine.load_config.load_format,
            "socket_dir": args.weight_cache_socket_dir, "health_port": args.weight_cache_health_port}


def main() -> None:
    if sys.argv[1] in ("--argv", "--preload-argv"):
        parse = parse_serve if sys.argv[1] == "--argv" else parse_preload
        print(json.dumps(parse(json.loads(sys.argv[2]))))
        return
    model_dir, socket = sys.argv[1], sys.argv[2]
    register()
    reference_config = engine_config(model_dir, "auto")
    with set_current_vllm_config(reference_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp()}")
        initialize_model_parallel(1, 1)
        reference = get_model_loader(reference_config.load_config).load_model(
            vllm_config=reference_config, model_config=reference_config.model_config)

    identity = names.ModelIdentity(model=model_dir, revision=None, dtype="float32",
                                   architecture="LlamaForCausalLM", engine="vllm",
                                   engine_version=vllm.__version__)
    weights = names.weights_layout(identity)
    kv = {memory.KV_CACHE: names.scratch_layout(identity, memory.KV_CACHE, os.getpid())}
    writer = GMSClientMemoryManager(socket, layout=weights)
    writer.connect(RequestedLockType.RW)
    published = gms.torch.publish_tensors(writer, list(gms.torch.module_tensors(reference)),
                                          prefix=names.tensor_prefix("vllm"))
    writer.metadata_put(names.identity_key("vllm"), writer.mappings[0].allocation_id, 0, identity.to_json())
    writer.commit()
    writer.close()

    engine = memory.EngineMemory.open(EngineConfig(), socket, 0, weights, kv, identity)
    granted = engine.connect().value
    memory.install(engine)
    gms_config = engine_config(model_dir, "gms")
    with set_current_vllm_config(gms_config):
        model = get_model_loader(gms_config.load_config).load_model(
            vllm_config=gms_config, model_config=gms_config.model_config)
    ref, got = reference.state_dict(), model.state_dict()
    spans = [(mp.va, mp.va + mp.size) for mp in engine.weights.mappings]
    params = list(model.named_parameters())

    other = names.ModelIdentity(model=model_dir, revision=None, dtype="bfloat16",
                                architecture="LlamaForCausalLM", engine="vllm",
                                engine_version=vllm.__version__)
    refused = None
    engine.identity = other  # this engine now stands for a bfloat16 one: the layout is not for it
    try:
        with set_current_vllm_config(gms_config):  # refused before any model is built
            get_model_loader(gms_config.load_config).load_model(vllm_config=gms_config,
                                                                model_config=gms_config.model_config)
    except LayoutMismatchError as exc:
        refused = str(exc)
    print(json.dumps({
        "published": published,
        "granted": granted,
        "names": sorted(ref) == sorted(got),
        "unequal": [k for k in ref if k in got and not torch.equal(ref[k], got[k])],
        "params": len(params),
        "params_in_gms": sum(any(lo <= p.data_ptr() < hi for lo, hi in spans) for _, p in params),
        "refused": refused,
    }))


if __name__ == "__main__":
    main()
