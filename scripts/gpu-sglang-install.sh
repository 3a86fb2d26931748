#!/usr/bin/env bash
# SGLang on an offline GPU host, from wheels carried in parts (docs/sglang.md).  Call once per
# part, each call on the same warm machine; the call that brings the last part installs:
#
#   bash scripts/gpu-sglang-install.sh .wheels/sglang-part1     # carry .wheels/base and the part
#   ...
#   bash scripts/gpu-sglang-install.sh .wheels/sglang-part3     # joins, checks sha256, installs
#
# The parts are made here by scripts/gpu_vllm_wheels.py (split) from the set that
# scripts/gpu-sglang-wheels.txt names (0.5.17: sglang-partK), or --lock
# scripts/gpu-sglang0523-wheels.txt (0.5.23 on torch 2.14.1: sglang0523-partK, 22 parts with nvidia-cutlass-dsl);
# the store is $GMS_VLLM_STORE (default below; a part of the other set starts it over).
# Exit 0 when installed and a served Llama's modules import, 3 while parts are missing.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
part=${1:?usage: gpu-sglang-install.sh .wheels/sglang-partK}
export GMS_VLLM_STORE=${GMS_VLLM_STORE:-/var/tmp/gms-sglang-wheels}
python3 scripts/gpu_vllm_wheels.py receive "$part"
status=$?
[ "$status" -eq 0 ] || exit "$status"
OUT=${OUT:-gpu-out} scripts/gpu-suite.sh run - <<'PY'
import importlib.metadata as md, sys, torch
import sglang
# What a served Llama imports (a missing wheel shows here, not in the middle of a run):
import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler  # noqa: E401
import sglang.srt.model_executor.model_runner, sglang.srt.models.llama, sgl_kernel  # noqa: E401
import gms.integrations.sglang.loader, gms.integrations.sglang.hooks  # noqa: E401
names = [e.value for e in md.entry_points(group="sglang.srt.plugins")]
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, sglang {sglang.__version__}, "
      f"transformers {md.version('transformers')}, cuda devices {torch.cuda.device_count()}; plugins: {names}")
assert "gms.integrations.sglang:register" in names, "the gms plugin is not registered"
PY
