#!/usr/bin/env bash
# vLLM on an offline GPU host, from wheels carried in parts (docs/vllm.md).  Call once per
# part, each call on the same warm machine; the call that brings the last part installs:
#
#   bash scripts/gpu-vllm-install.sh .wheels/vllm-part1
#   ...
#   bash scripts/gpu-vllm-install.sh .wheels/vllm-part6     # joins, checks sha256, installs
#
# Each call copies its part into $GMS_VLLM_STORE (default /var/tmp/gms-vllm-wheels, kept while
# the machine stays warm) and prints which parts arrived and which are missing.  Once all are
# there: the pieces are joined, every wheel's sha256 is checked against MANIFEST.json, and
# `pip install --no-index --no-deps` puts them into the system python3 (the image's, the one
# with torch), so every process vLLM or the bench starts finds them without PYTHONPATH; then
# gms itself (`pip install --no-deps --no-build-isolation -e .`).  Exit 0 when installed,
# 3 while parts are missing, anything else on an error.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
part=${1:?usage: gpu-vllm-install.sh .wheels/vllm-partK}
python3 scripts/gpu_vllm_wheels.py receive "$part"
status=$?
[ "$status" -eq 0 ] || exit "$status"
python3 -m pip show -q gms >/dev/null 2>&1 \
  || python3 -m pip install -q --no-deps --no-build-isolation --disable-pip-version-check -e . || exit 1
python3 scripts/gpu_vllm_wheels.py check
python3 - <<'PY' || exit 1
import importlib.metadata as md, sys, torch
import vllm
# What a served Llama imports (a missing wheel shows here, not in the middle of a benchmark):
import vllm.entrypoints.openai.api_server, vllm.v1.engine.core, vllm.v1.worker.gpu_worker  # noqa: E401
import vllm.v1.worker.gpu.model_runner, vllm.model_executor.models.llama  # noqa: E401
import vllm.v1.attention.backends.flash_attn, vllm.vllm_flash_attn  # noqa: E401
import gms.integrations.vllm.worker, gms.integrations.vllm.endpoints  # noqa: E401
names = [e.value for e in md.entry_points(group="vllm.general_plugins")]
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, vllm {vllm.__version__}, "
      f"cuda devices {torch.cuda.device_count()}; vllm.general_plugins: {names}")
assert any(v.startswith("gms.integrations.vllm") for v in names), "the gms plugin is not registered"
PY
