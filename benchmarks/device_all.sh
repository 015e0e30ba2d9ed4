#!/usr/bin/env bash
# One call on the GPU machine (device tool): install, then run the named stages.
#   bash benchmarks/device_all.sh tests skinny fp8 "bench:fp8_block --quick" ...
# Stages: prebuild (every CUTLASS fp8_block library, 3 output dtypes, 12 nvcc at a
# time: about 4 min; skip it by carrying benchmarks/out/jit-cache built on the CPU
# machine), tests (pytest-xdist over tests/ and compile_tests/; SCALEDMM_TESTS=gpu
# keeps the GPU cases; with an empty JIT cache the CUTLASS builds alone exceed one
# call: prebuild or carry first), tests:<pytest args>, bench:<CLI args> (python -m benchmarks ...
# --out <work>/bench), sanitize[:<args>] (python -m benchmarks sanitize), tune (after a
# "bench:fp8_block ... --providers ..." sweep: scaledmm/tuning/fp8_block_sm90.json from its
# CSV, via python -m benchmarks.tune), <name> for python -m benchmarks.experiments.<name>,
# run:<shell command>.
# Everything lands in a work folder; $OUT gets one archive of it (the device tool
# returns at most 8 files) plus benchmarks/RESULTS.md, and the tail of every
# stage's log is printed last.  Timeouts: TESTS_TIMEOUT, BENCH_TIMEOUT, SCRIPT_TIMEOUT.
set -u
export PYTHONUNBUFFERED=1
FINAL_OUT=${OUT:-/tmp/scaledmm-out}
WORK=/tmp/scaledmm-run
mkdir -p "$FINAL_OUT" "$WORK"
export OUT=$WORK  # scripts write their JSON here
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$WORK/install.log" 2>&1 || { cat "$WORK/install.log"; exit 1; }
# Prebuilt CUTLASS libraries (built on the CPU machine with the same nvcc 13.0): carry this folder.
[ -d benchmarks/out/jit-cache ] && export SCALEDMM_CACHE_DIR=$PWD/benchmarks/out/jit-cache
export SCALEDMM_COMMIT=${SCALEDMM_COMMIT:-$(cat .commit 2>/dev/null || echo unknown)}
export SCALEDMM_FAILURE_LOG=${SCALEDMM_FAILURE_LOG:-$WORK/failures.log}  # test failures, written as they happen
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
summary=()
names=()
for stage in "$@"; do
  name=$(echo "$stage" | tr -c 'A-Za-z0-9_.-' '_' | cut -c1-40)
  names+=("$name")
  t0=$(date +%s)
  case "$stage" in
    prebuild) timeout "${SCRIPT_TIMEOUT:-300}" python3 -m scaledmm.jit build --jobs 12 \
             --fp8-block-cutlass all:bf16,fp16,fp32 >"$WORK/$name.log" 2>&1 ;;
    tests) timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest tests compile_tests -q -p no:cacheprovider -n 14 \
             --timeout 80 -rfE --junitxml="$WORK/junit.xml" \
             -W ignore::pytest_benchmark.logger.PytestBenchmarkWarning >"$WORK/$name.log" 2>&1 ;;
    tests:*) timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest ${stage#tests:} -q -p no:cacheprovider --timeout 80 \
             -rfE >"$WORK/$name.log" 2>&1 ;;
    run:*) timeout "${SCRIPT_TIMEOUT:-300}" bash -c "${stage#run:}" >"$WORK/$name.log" 2>&1 ;;
    bench:*) timeout "${BENCH_TIMEOUT:-420}" python3 -m benchmarks ${stage#bench:} --out "$WORK/bench" \
             >"$WORK/$name.log" 2>&1 ;;
    sanitize) timeout "${SCRIPT_TIMEOUT:-300}" python3 -m benchmarks sanitize --out "$WORK" >"$WORK/$name.log" 2>&1 ;;
    sanitize:*) timeout "${SCRIPT_TIMEOUT:-300}" python3 -m benchmarks sanitize ${stage#sanitize:} --out "$WORK" \
             >"$WORK/$name.log" 2>&1 ;;
    tune) table=scaledmm/tuning/fp8_block_sm90.json
          { cp "$WORK/bench/fp8_block.csv" "$WORK/sweep_fp8_block.csv" \
              && cp "$WORK/bench/meta.json" "$WORK/sweep_meta.json" && cp "$WORK/bench/meta.json" "$WORK/meta.json" \
              && timeout "${SCRIPT_TIMEOUT:-300}" python3 -m benchmarks.tune "$WORK/sweep_fp8_block.csv" --out "$table" \
              && cp "$table" "$WORK/" && cat "$table"; } >"$WORK/$name.log" 2>&1 ;;
    *) timeout "${SCRIPT_TIMEOUT:-300}" python3 -m "benchmarks.experiments.$stage" >"$WORK/$name.log" 2>&1 ;;
  esac
  rc=$?
  summary+=("== $stage: rc=$rc, $(( $(date +%s) - t0 )) s")
  cp benchmarks/RESULTS.md "$FINAL_OUT/RESULTS.md" 2>/dev/null
  tar czf "$FINAL_OUT/run.tgz" -C "$WORK" . 2>/dev/null  # after every stage: a timeout keeps what ran
done
for name in "${names[@]}"; do
  echo; echo "######## $name"; tail -n 30 "$WORK/$name.log"
done
printf '%s\n' "${summary[@]}"
