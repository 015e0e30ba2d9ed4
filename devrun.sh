#!/usr/bin/env bash
# one device call (not committed)
W=/tmp/scaledmm-run
export SCRIPT_TIMEOUT=340 BENCH_TIMEOUT=120
bash benchmarks/device_all.sh \
  "run:python3 -m benchmarks sweep --kernel fp8_wgmma --shapes llama8b --out $W/sw && python3 -m benchmarks.tune $W/sw/fp8_wgmma_sweep.csv --kernel fp8_wgmma --out scaledmm/tuning/kernels/fp8_wgmma_sm90.json && cp scaledmm/tuning/kernels/fp8_wgmma_sm90.json $W/" \
  "bench:fp8 --shapes llama8b --m 1,2,4,8,16,32,64,128,256,512 --providers auto,cublas,triton,cuda_wgmma --no-plots" \
  "run:python3 -m benchmarks.tune $W/bench/fp8.csv --op fp8_scaled_mm --op-rows --variant rowwise --any-shape --out scaledmm/tuning/fp8_sm90.json" \
  "bench:fp8_tensorwise --shapes llama8b --m 1,2,4,8,16,32,64,128,256,512 --providers auto,cublas,triton,cuda_wgmma --no-plots" \
  "run:python3 -m benchmarks.tune $W/bench/fp8_tensorwise.csv --op fp8_scaled_mm --op-rows --variant tensorwise --any-shape --out scaledmm/tuning/fp8_sm90.json && cp scaledmm/tuning/fp8_sm90.json $W/" \
  "bench:model --models llama8b --no-generate --formats fp8,fp8_tensor"
