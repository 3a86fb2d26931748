#!/usr/bin/env bash
# Every vLLM run a GPU lease makes once vLLM is installed (scripts/gpu-vllm-install.sh), in
# the order they matter, in the background: a lease's call may last 10 minutes, the runs
# together more.  docs/vllm.md, "Running on a GPU host".
#
#   scripts/gpu-vllm-lease.sh start      # setsid: runs on after the call returns
#   scripts/gpu-vllm-lease.sh wait S     # up to S seconds for it to end; prints where it is
#   scripts/gpu-vllm-lease.sh collect    # its logs and results, one tarball in $OUT
#
# The runs outlive the call that starts them, and each later call to the device copies the
# working tree again (a server started in the middle of that found half a package): so they
# run from a copy of the tree of their own, $RUNS/tree, first on PYTHONPATH.
#
# Steps (each logged to $RUNS/<step>.log, its exit code to $RUNS/<step>.rc), in the order
# $STEPS names them (default below); "a+b" runs a and b side by side:
#   test_vllm_gpu: publish and import, tokens equal to vLLM's own load, sleep and wake through
#      vLLM's endpoints with CUDA graphs replaying (tests/test_vllm_gpu.py);
#   gms_gpu: gms's own restart, take-over, disk tier and copier tests on CUDA (alone: they count memory);
#      before vLLM's install it runs on the image's torch, with gms's wheels on PYTHONPATH;
#   model_based: the model-based machines on CUDA;
#   gms_rest: every other gms GPU test but the engines' and Ray's (the client, what maps, torch,
#      tenants, trust; about 6 minutes on an H100);
#   disk_tier_cuda: bench/disk_tier.py on CUDA (save and restore against the disk's floors);
#   vllm_daemons: bench/vllm_daemons.py --eager: vLLM alone, `vllm preload` + ipc_cache, gms;
#   test_vllm_disk_gpu: an engine imports weights the disk tier kept over a reboot;
#   vllm_failover: bench/vllm.py --parts failover --eager: `gms failover` over two engines;
#   test_sglang_gpu, sglang_gms, sglang_daemons: SGLang's (installed by scripts/gpu-sglang-install.sh
#      instead): its GPU tests, bench/sglang_gms.py (share, release and resume, restart, failover),
#      bench/sglang_daemons.py (against SGLang's own weight cache daemon).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
RUNS=${RUNS:-/var/tmp/gms-vllm-lease}
STEPS=${STEPS:-test_vllm_gpu+gms_gpu vllm_daemons test_vllm_disk_gpu vllm_failover}
export PYTHONUNBUFFERED=1 PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 GMS_BENCH_OUT=$RUNS/results

PYTEST="python3 -m pytest -q -rs -o addopts=-ra -p no:cacheprovider -p no:randomly -m gpu --timeout 900"  # one process: no xdist

run_step() {
  case "$1" in
    test_vllm_gpu) step "$1" $PYTEST tests/test_vllm_gpu.py ;;
    gms_gpu) step "$1" $PYTEST tests/test_restart_gpu.py tests/test_disk_tier_gpu.py tests/test_copier_process.py \
      tests/test_copier.py tests/test_takeover.py tests/test_restart.py ;;
    model_based) step "$1" $PYTEST tests/model_based ;;
    gms_rest) step "$1" $PYTEST tests/test_client.py tests/test_client_ride_through.py tests/test_client_deadlines.py \
      tests/test_residency.py tests/test_layouts.py tests/test_server_locks.py tests/test_torch_gpu.py tests/test_torch.py \
      tests/test_server_lifecycle.py tests/test_tenants.py tests/test_server_trust.py tests/test_wakeups.py \
      tests/test_gpu.py tests/test_seed_contract.py tests/test_supervisor.py tests/test_client_polling.py ;;
    disk_tier_cuda) step "$1" python3 bench/disk_tier.py --backend cuda --size "${DISK_SIZE:-4GiB}" --repeats 2 --dir /var/tmp ;;
    vllm_daemons) step "$1" python3 bench/vllm_daemons.py --eager --shape "${SHAPE:-llama-2b}" ${SETUPS:+--setups "$SETUPS"} ;;
    test_vllm_disk_gpu) step "$1" $PYTEST tests/test_vllm_disk_gpu.py ;;
    vllm_failover) step "$1" python3 bench/vllm.py --parts failover --eager --repeats 2 --shape "${SHAPE:-llama-2b}" ;;
    test_sglang_gpu) step "$1" $PYTEST tests/test_sglang_gpu.py ;;
    sglang_gms) step "$1" python3 bench/sglang_gms.py --shape "${SHAPE:-llama-2b}" ;;
    sglang_daemons) step "$1" python3 bench/sglang_daemons.py --shape "${SHAPE:-llama-2b}" ${SETUPS:+--setups "$SETUPS"} ;;
    *) echo "unknown step $1" >> "$RUNS/progress" ;;
  esac
}

steps() {
  for group in $STEPS; do
    for name in ${group//+/ }; do run_step "$name" & done
    wait
  done
}

step() {
  local name=$1; shift
  echo "$(date -u +%T) start $name: $*" >> "$RUNS/progress"
  local t0=$SECONDS
  "$@" > "$RUNS/$name.log" 2>&1
  local rc=$?
  echo "$rc" > "$RUNS/$name.rc"
  echo "$(date -u +%T) end $name: rc $rc in $((SECONDS - t0)) s" >> "$RUNS/progress"
}

case "${1:-}" in
  start)
    mkdir -p "$RUNS/results"
    : > "$RUNS/progress"
    rm -rf "$RUNS/tree" && mkdir -p "$RUNS/tree" && cp -a gms bench scripts tests examples pyproject.toml "$RUNS/tree"/
    { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
      python3 -c 'import sys, torch, vllm; print(sys.version.split()[0], "torch", torch.__version__, "vllm", vllm.__version__)'
    } > "$RUNS/env.txt" 2>&1
    setsid bash -c "$(declare -f steps step run_step); RUNS=$RUNS; STEPS='$STEPS'; PYTEST='$PYTEST'; SETUPS='${SETUPS:-}';
      cd $RUNS/tree && export PYTHONPATH=$RUNS/tree\${PYTHONPATH:+:\$PYTHONPATH}; steps; echo done >> $RUNS/progress" \
      < /dev/null > "$RUNS/lease.log" 2>&1 &
    echo "started: $RUNS/progress"
    ;;
  wait)
    deadline=$((SECONDS + ${2:-540}))
    while [ $SECONDS -lt $deadline ] && ! grep -q '^done' "$RUNS/progress" 2>/dev/null; do sleep 5; done
    cat "$RUNS/progress"
    for f in "$RUNS"/*.rc; do [ -e "$f" ] && echo "$(basename "$f" .rc): rc $(cat "$f")"; done
    grep -hE "passed|failed|error" "$RUNS"/test_*.log 2>/dev/null | tail -5
    ;;
  collect)
    tar -C "$RUNS" --exclude=./tree -czf "${OUT:-.}/$(basename "$RUNS").tgz" . && ls -l "${OUT:-.}/$(basename "$RUNS").tgz"
    ;;
  *) echo "usage: $0 start|wait [S]|collect" >&2; exit 2 ;;
esac
