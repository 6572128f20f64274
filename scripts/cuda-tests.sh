#!/usr/bin/env bash
# Run the whole test suite on a CUDA machine and record the result.
#
# Usage: scripts/cuda-tests.sh [RESULTS_DIR]     (default: benchmarks/results)
#
# Works on a machine with network (after `pip install -e ".[test]"`) and on an offline
# one: if ./.whl holds wheels (../shared/scripts/offline-wheels.sh), they are installed
# into /tmp/site first. The package itself is installed from this tree in editable mode
# with no index and no build isolation (the build uses the setuptools already there, so
# no network is needed); that maps trio_cuda.kernels to kernels/. The compiled parts (the
# fast path, and the runtime's hot modules through Cython, carried as a wheel in .whl/)
# are then built in place, and the suite requires them. It writes cuda-suite.md and cuda-suite.log, replacing the last ones
# (older runs are in git history).
set -uo pipefail
cd "$(dirname "$0")/.."
results=${1:-benchmarks/results}
mkdir -p "$results"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# Already installed (pip install -e ".[test]" on a machine with network): nothing to do.
python3 -c "import trio_cuda.kernels" 2>/dev/null ||
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
# The compiled parts, in place, when not built yet: the fast path
# (trio_cuda/_backends/_cudafast.c) and the hot modules (Cython, trio_cuda._compiled.MODULES).
if ! TRIO_CUDA_REQUIRE_COMPILED=1 python3 -c "import trio_cuda._backends._cudafast, trio_cuda" 2>/dev/null; then
  python3 setup.py -q build_ext --inplace -j "$(nproc)" ||
    echo "cuda-tests.sh: the compiled parts could not all be built" >&2
fi
if TRIO_CUDA_REQUIRE_COMPILED=1 python3 -c "import trio_cuda" 2>/dev/null; then
  export TRIO_CUDA_REQUIRE_COMPILED=1
else
  echo "cuda-tests.sh: the hot modules are not compiled; the suite runs them interpreted" >&2
fi
export TRIO_CUDA_BACKEND=cuda PYTHONUNBUFFERED=1
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
day=$(date -u +%Y-%m-%d)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
log="$results/cuda-suite.log"
python3 -m pytest -q -rs -p no:cacheprovider 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
summary=$(grep -E "^(=+ )?[0-9]+ (passed|failed)|[0-9]+ (passed|failed|skipped|error)" "$log" | tail -1)
{
  echo "# Test suite on CUDA ($day)"
  echo
  echo "- commit: $commit"
  echo "- GPU: ${gpu:-unknown}"
  echo "- command: scripts/cuda-tests.sh (TRIO_CUDA_BACKEND=cuda python3 -m pytest -q -rs)"
  echo "- compiled modules: $(python3 -c 'import trio_cuda; print(len(trio_cuda.lowlevel.compiled()))' 2>/dev/null) of $(python3 -c 'from trio_cuda._compiled import MODULES; print(len(MODULES))' 2>/dev/null)"
  echo "- python: $(python3 --version 2>&1); numba-cuda: $(python3 -c 'import numba_cuda; print(numba_cuda.__version__)' 2>/dev/null); cuda-bindings: $(python3 -c 'import cuda.bindings; print(cuda.bindings.__version__)' 2>/dev/null); numpy: $(python3 -c 'import numpy; print(numpy.__version__)')"
  echo "- result: ${summary:-no summary} (exit status $rc)"
  echo
  echo "Skipped tests and their reasons:"
  echo
  grep -E "^SKIPPED" "$log" | sed 's/^/    /'
} > "$results/cuda-suite.md"
cat "$results/cuda-suite.md"
exit "$rc"
