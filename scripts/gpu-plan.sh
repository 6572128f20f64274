#!/usr/bin/env bash
# The benchmarks and probes that need a GPU, in one call, by priority, each under a time
# cap, within a total budget: for a lent machine whose time is short.
#
# Usage: scripts/gpu-plan.sh OUT_DIR [STEP ...]
# Wheels (made here, carried as .whl): ../shared/scripts/offline-wheels.sh "cython>=3.1"
#   fastapi uvicorn starlette "pydantic>=2" pydantic-core annotated-types typing-inspection
#   opentelemetry-api nvidia-cudnn-frontend
#   STEP: any of the names below (default: all, in this order). Env: BUDGET_S (total, default
#   540), and per step its cap in seconds (e.g. CAP_serve=150).
#
# Setup as scripts/cuda-tests.sh (offline wheels from ./.whl if present, the package
# installed from this tree, the compiled parts built in place). Each step writes
# OUT_DIR/NAME.log and its result files under OUT_DIR; every log is also appended to
# OUT_DIR/all.log, one file that holds everything (a lent machine may return few files).
# A step that does not fit in what is left of the budget is skipped and says so.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu-plan.sh OUT_DIR [STEP ...]}
shift
mkdir -p "$out"
all="$out/all.log"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -c "import trio_cuda.kernels" 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$all" 2>&1 || exit 1
if ! TRIO_CUDA_REQUIRE_COMPILED=1 python3 -c "import trio_cuda._backends._cudafast, trio_cuda" 2>/dev/null; then
  python3 setup.py -q build_ext --inplace -j "$(nproc)" >>"$all" 2>&1 ||
    echo "gpu-plan.sh: the compiled parts could not all be built" | tee -a "$all" >&2
fi
export TRIO_CUDA_BACKEND=${TRIO_CUDA_BACKEND:-cuda} PYTHONUNBUFFERED=1
TRIO_CUDA_REQUIRE_COMPILED=1 python3 -c "import trio_cuda" 2>/dev/null && export TRIO_CUDA_REQUIRE_COMPILED=1
{
  echo "== gpu-plan $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 | head -1
  python3 -c "import trio_cuda.lowlevel as l; print('compiled:', len(l.compiled()), 'modules')" 2>&1
} | tee -a "$all"

# name | default cap (s) | command
steps=(
  "roundtrip|60|taskset -c 2 python3 benchmarks/probes/probe_roundtrip.py --batches 30"
  "half_tests|120|python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_norm.py tests/ops/test_half.py tests/ops/test_half_bits.py"
  "ops_half|40|python3 benchmarks/bench_ops.py --only norm --reps 50"
  "sdpa_host|60|python3 benchmarks/probes/probe_sdpa_host.py"
  "notifier_tests|60|python3 -m pytest -q -s -p no:cacheprovider tests/runtime/test_notifier.py"
  "host|150|python3 benchmarks/bench_host.py --tiny-rounds 3 --rounds 3 --reps 3 --out $out"
  "optim_probe|90|python3 benchmarks/probes/probe_optim.py --rounds 3"
  "optim|60|python3 benchmarks/bench_optim.py --reps 20 --out $out"
  "norm_probe|60|python3 benchmarks/probes/probe_norm.py"
  "ops_norm|90|python3 benchmarks/bench_ops.py --only norm,softmax --reps 50 --out $out"
  "serve|150|python3 benchmarks/bench_serve.py --rounds 3 --requests 3000 --out $out"
  "attention|60|python3 benchmarks/bench_attention.py --out $out"
  "wait|150|python3 benchmarks/bench_wait.py --out $out"
  "ddp|120|python3 -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/bench_ddp.py --processes --out $out"
)
budget=${BUDGET_S:-540}
start=$SECONDS
for entry in "${steps[@]}"; do
  IFS='|' read -r name cap cmd <<<"$entry"
  if [ $# -gt 0 ] && [[ " $* " != *" $name "* ]]; then
    continue
  fi
  var="CAP_$name"
  cap=${!var:-$cap}
  left=$((budget - (SECONDS - start)))
  if [ "$left" -lt "$cap" ]; then
    echo "== $name: skipped (cap ${cap}s, ${left}s of the budget left)" | tee -a "$all"
    continue
  fi
  log="$out/$name.log"
  t0=$SECONDS
  timeout "$cap" bash -c "$cmd" >"$log" 2>&1
  rc=$?
  { echo "== $name: rc=$rc in $((SECONDS - t0)) s: $cmd"; cat "$log"; } >>"$all"
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
done
echo "== done in $((SECONDS - start)) s" | tee -a "$all"
