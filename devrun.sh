#!/usr/bin/env bash
# one device call (not committed)
W=/tmp/scaledmm-run
export SCALEDMM_TESTS=gpu TESTS_TIMEOUT=230 SCRIPT_TIMEOUT=240
bash benchmarks/device_all.sh \
  "tests:tests/test_fp8_wgmma.py -n 14 -x" \
  "sanitize:--only fp8_wgmma" \
  "run:python3 -m benchmarks sweep --kernel fp8_wgmma_block --shapes llama8b --m 1,8,64,128 --out $W/swb && python3 -m benchmarks.tune $W/swb/fp8_wgmma_block_sweep.csv --kernel fp8_wgmma_block --out scaledmm/tuning/kernels/fp8_wgmma_block_sm90.json && cp scaledmm/tuning/kernels/fp8_wgmma_block_sm90.json $W/" \
  "run:python3 -m benchmarks sweep --kernel fp8_wgmma --shapes 6144x4096,4096x14336 --m 64,128 --out $W/swc"
