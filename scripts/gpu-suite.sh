#!/usr/bin/env bash
# The whole test suite (CPU and GPU tests) and, optionally, the GPU benchmarks,
# on a GPU host with no network (docs/gpu.md).  Logs go to $OUT (default gpu-out/).
#
#   scripts/gpu-suite.sh tests [pytest args...]
#   scripts/gpu-suite.sh bench NAME [bench args...]    # bench/NAME.py
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
wheels=$(ls .wheels/*.whl .wheels/base/*.whl 2>/dev/null)
if [ -n "$wheels" ] && [ ! -e /tmp/site/.gms-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $wheels && touch /tmp/site/.gms-wheels || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 -m pip show -q gms >/dev/null 2>&1 || python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1
export PYTHONUNBUFFERED=1
mode=${1:-tests}; shift || true
case "$mode" in
  tests)
    {
      date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
      python3 -c 'import sys, torch, cuda.bindings; print(sys.version.split()[0], "torch", torch.__version__, "cuda-bindings", cuda.bindings.__version__)'
    } > "$OUT/env.txt" 2>&1
    # the whole suite unless a path under tests/ is named
    paths=tests; for a in "$@"; do case "$a" in tests/*) paths= ;; esac; done
    # one process (-o addopts: pyproject's -n needs pytest-xdist, which the image lacks; GPU tests share a device)
    python3 -m pytest -q -rs -o addopts=-ra -p no:cacheprovider --timeout 600 $paths "$@" 2>&1 | tee "$OUT/${LOG:-pytest}.log"
    ;;
  bench)
    name=$1; shift
    GMS_BENCH_OUT="$OUT" python3 "bench/$name.py" "$@" 2>&1 | tee "$OUT/bench-$name.log"
    ;;
  run)
    python3 "$@" 2>&1 | tee -a "$OUT/run.log"
    ;;
  *) echo "usage: $0 tests|bench NAME|run SCRIPT" >&2; exit 2 ;;
esac
