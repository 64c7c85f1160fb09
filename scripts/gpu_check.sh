#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU (no network: what it lacks travels as wheels made by
# scripts/gpu_wheels.sh, .whl/ for surgery and .whl-peer/ for llm-compressor), run surgery's CUDA
# tests (pytest -m cuda: the kernels' tests and every verb's device tests on cuda) and the timing
# table of benchmarks/bench_gpu.py, in at most 8 minutes on one H100. Results in OUT (default
# gpu_check_out/): tests.log, gpu_check.json, gpu_check.md. Exits 1 if a test or a row failed.
#
#   bash scripts/gpu_check.sh                   # on the GPU machine
#   bash scripts/gpu_check.sh --dry-run         # anywhere: toy sizes; what needs CUDA is skipped
#   bash scripts/gpu_check.sh --out=DIR         # results elsewhere (or OUT=DIR)
#   PYTHON=.venv/bin/python bash scripts/gpu_check.sh --dry-run
set -uo pipefail
cd "$(dirname "$0")/.."
dry=""
out="${OUT:-gpu_check_out}"
python="${PYTHON:-python3}"
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry="--dry-run" ;;
    --out=*) out="${arg#--out=}" ;;
    *) echo "gpu_check: unknown argument '$arg' (allowed: --dry-run, --out=DIR)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
if [ -z "$dry" ] && ! "$python" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_check: no CUDA GPU here; run with --dry-run" >&2
  exit 1
fi
installed="$(mktemp -d)"
trap 'rm -rf "$installed"' EXIT
site=""
peer=""
if [ -z "$dry" ] && [ -d .whl ] && compgen -G ".whl/*.whl" >/dev/null; then  # the GPU machine's Python 3.12
  site="$installed/site"
  "$python" -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target "$site" \
    .whl/*.whl .whl/*.tar.gz || exit 1
fi
if [ -z "$dry" ] && [ -d .whl-peer ] && compgen -G ".whl-peer/*.whl" >/dev/null; then
  peer="$installed/peer"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$peer" .whl-peer/*.whl || exit 1
fi
export PYTHONPATH="$PWD${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
"$python" -c "import torch; print('gpu_check:', torch.__version__, 'CUDA', torch.cuda.is_available() and torch.cuda.get_device_name(0))"

# the CUDA tests (skipped where there is no GPU), at most 4 minutes
timeout -k 15 240 "$python" -m pytest -q -p no:cacheprovider -m cuda tests/test_devices.py tests/ops/export \
  2>&1 | tee "$out/tests.log"
tests=${PIPESTATUS[0]}
if [ "$tests" = 5 ]; then tests=0; fi  # no test selected (none marked cuda collected): not a failure

# the timing table, at most 4 minutes
timeout -k 15 240 "$python" benchmarks/bench_gpu.py --out "$out" $dry ${peer:+--peer-path "$peer"}
bench=$?
echo "gpu_check: tests exit $tests, bench exit $bench; results in $out"
[ "$tests" = 0 ] && [ "$bench" = 0 ]
