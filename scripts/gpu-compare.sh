#!/usr/bin/env bash
# The host path of an older commit against this tree's, in interleaved processes on a GPU
# machine (each process runs its own tree's benchmark): bench_host twice each, then
# bench_decode and bench_ops once each, every step under a cap within a total budget.
#
# Here (with git):  scripts/gpu-compare.sh prepare [OLD_COMMIT]   (default 2c863ad: the
#                   hand-written C hot path) writes OLD_COMMIT's tree to .gpu/old (ignored)
# There:            scripts/gpu-compare.sh run OUT_DIR            (carry .whl and .gpu)
#
# Env: BUDGET_S (default 540). Wheels as scripts/gpu-plan.sh. OUT_DIR gets all.log (every
# step's output) and res.tgz (each step's report and record), few files as a lent machine
# returns few.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
case "${1:-}" in
prepare)
  old=${2:-2c863ad}
  rm -rf .gpu/old && mkdir -p .gpu/old && git archive "$old" | tar -x -C .gpu/old || exit 1
  # an old tree run from its folder (no install) finds the kernel library through a link
  [ -e .gpu/old/trio_cuda/kernels ] || ln -s ../kernels .gpu/old/trio_cuda/kernels
  git rev-parse --short "$old" >.gpu/old/COMMIT
  echo "prepared .gpu/old at $(cat .gpu/old/COMMIT)"
  exit 0
  ;;
run) out=${2:?usage: scripts/gpu-compare.sh run OUT_DIR} ;;
*) echo "usage: scripts/gpu-compare.sh prepare [OLD_COMMIT] | run OUT_DIR" >&2; exit 2 ;;
esac
[ -d .gpu/old ] || { echo "no .gpu/old: run 'scripts/gpu-compare.sh prepare' first (here) and carry .gpu" >&2; exit 1; }
mkdir -p "$out" /tmp/res
all="$out/all.log"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
site=/tmp/site
[ -e trio_cuda/kernels ] || ln -s ../kernels trio_cuda/kernels
(PYTHONPATH=$site python3 setup.py -q build_ext --inplace -j 12 >/tmp/res/build-new.log 2>&1; echo "new build rc=$?") &
(cd .gpu/old && PYTHONPATH=$site python3 setup.py -q build_ext --inplace -j 4 >/tmp/res/build-old.log 2>&1; echo "old build rc=$?") &
wait
export TRIO_CUDA_BACKEND=cuda PYTHONUNBUFFERED=1
{
  echo "== gpu-compare $(date -u +%FT%TZ): old $(cat .gpu/old/COMMIT), new $(git rev-parse --short HEAD 2>/dev/null || echo '(tree)')"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1
} | tee -a "$all"
budget=${BUDGET_S:-540}
start=$SECONDS
step() {  # step NAME CAP (old|new) CMD...
  local name=$1 cap=$2 tree=$3 t0=$SECONDS rc dir
  shift 3
  if [ $((SECONDS - start + cap)) -gt "$budget" ]; then
    echo "== $name: skipped (cap ${cap}s, $((budget - SECONDS + start))s of the budget left)" | tee -a "$all"
    return
  fi
  dir=$root
  [ "$tree" = old ] && dir=$root/.gpu/old
  (cd "$dir" && PYTHONPATH=$site:$dir timeout "$cap" "$@") >"/tmp/res/$name.log" 2>&1
  rc=$?
  { echo "== $name ($tree): rc=$rc in $((SECONDS - t0)) s: $*"; cat "/tmp/res/$name.log"; } >>"$all"
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  (cd /tmp && tar czf "$out/res.tgz" res)
}
hb="python3 benchmarks/bench_host.py --tiny-rounds 3 --rounds 3 --reps 3 --tasks-extra 16 --tokens 20"
step host-old-1 110 old $hb --out /tmp/res/host-old-1
step host-new-1 110 new $hb --out /tmp/res/host-new-1
step host-old-2 110 old $hb --out /tmp/res/host-old-2
step host-new-2 110 new $hb --out /tmp/res/host-new-2
step decode-old 60 old python3 benchmarks/bench_decode.py --tokens 50 --out /tmp/res/decode-old
step decode-new 60 new python3 benchmarks/bench_decode.py --tokens 50 --out /tmp/res/decode-new
step ops-old 70 old python3 benchmarks/bench_ops.py --reps 30 --out /tmp/res/ops-old
step ops-new 70 new python3 benchmarks/bench_ops.py --reps 30 --out /tmp/res/ops-new
echo "== done in $((SECONDS - start)) s" | tee -a "$all"
