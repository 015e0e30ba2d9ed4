#!/usr/bin/env bash
# One call on the GPU machine (device tool): install, then run the named stages.
#   bash benchmarks/device_all.sh tests skinny fp8 "bench:fp8_block --quick" ...
# Stages: tests (whole suite, pytest-xdist; SCALEDMM_TESTS=gpu keeps the GPU cases), tests:<pytest args>, any
# benchmarks/device_<name>.py as <name>, bench:<CLI args> (python -m benchmarks).
# Every stage's log goes to $OUT/<stage>.log; the tail of each is printed last.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/scaledmm-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
# Prebuilt CUTLASS libraries (built on the CPU machine with the same nvcc 13.0): carry this folder.
[ -d benchmarks/out/jit-cache ] && export SCALEDMM_CACHE_DIR=$PWD/benchmarks/out/jit-cache
export SCALEDMM_COMMIT=${SCALEDMM_COMMIT:-$(cat .commit 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
summary=()
for stage in "$@"; do
  name=$(echo "$stage" | tr -c 'A-Za-z0-9_.-' '_' | cut -c1-40)
  t0=$(date +%s)
  case "$stage" in
    tests) timeout ${TESTS_TIMEOUT:-420} python3 -m pytest tests compile_tests -q -p no:cacheprovider -n 14 --timeout 80 -rfE \
             --junitxml="$OUT/junit.xml" -W ignore::pytest_benchmark.logger.PytestBenchmarkWarning >"$OUT/$name.log" 2>&1 ;;
    tests:*) timeout 420 python3 -m pytest ${stage#tests:} -q -p no:cacheprovider --timeout 150 -rfE >"$OUT/$name.log" 2>&1 ;;
    bench:*) timeout ${BENCH_TIMEOUT:-420} python3 -m benchmarks ${stage#bench:} --out "$OUT/bench" >"$OUT/$name.log" 2>&1 ;;
    *) timeout 300 python3 "benchmarks/device_$stage.py" >"$OUT/$name.log" 2>&1 ;;
  esac
  rc=$?
  summary+=("== $stage: rc=$rc, $(( $(date +%s) - t0 )) s")
done
for stage in "$@"; do
  name=$(echo "$stage" | tr -c 'A-Za-z0-9_.-' '_' | cut -c1-40)
  echo; echo "######## $stage"; tail -n 40 "$OUT/$name.log"
done
printf '%s\n' "${summary[@]}"
