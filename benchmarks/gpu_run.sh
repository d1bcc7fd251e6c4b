#!/usr/bin/env bash
# Everything that needs a GPU, in stages, each bounded in time, logs and JSON under $OUT
# (or ./gpu_out when $OUT is unset). Uses the machine's own torch; does not reinstall it.
#
#   bash benchmarks/gpu_run.sh tests 300 cast profile   # the newest GPU tests, the suite (its time limit), cast and memory scripts
#   bash benchmarks/gpu_run.sh cuda 240                  # only the GPU tests of the newest CUDA-path fixes
#   bash benchmarks/gpu_run.sh bench "mlp gpt-compute-bound" 0 300          # presets, RSS-trace steps, time limit
#   bash benchmarks/gpu_run.sh bench "gpt-capped" 0 300 "--steps 5 --warmup 2"
#   bash benchmarks/gpu_run.sh maxmodel 2 540 "--compute-dtype bf16"        # largest model under a 2 GiB cap, time limit
#   bash benchmarks/gpu_run.sh storage 400                                    # the disk tier against this machine's disk
#   bash benchmarks/gpu_run.sh scale 540 "--layers 24 --compute-dtype bfloat16 --masters-on-disk"  # tiers feeding a GPU
#   bash benchmarks/gpu_run.sh activations 240 "--d-model 1024 --seq-len 2048"  # recompute / offload / kept graph
#   bash benchmarks/gpu_run.sh schedule 420 "--threads 4"                      # update in backward / next forward / serial,
#                                    # and the first two with 1 and 2 resident slices (10 runs a ratio and round
#                                    # instead of 4: about 2.5 times the stage's time; "--resident" alone leaves them out)
#
# A fairscale wheel under .whl/ (not a dependency) is installed for the comparison when present.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# GPU tests of the CUDA-path fixes no GPU has run yet: first, so a short run still reports them.
NEW_CUDA_TESTS="tests/test_grad_scaler.py tests/test_cuda.py tests/test_pinned.py tests/test_cuda_devices.py
    tests/test_memory.py tests/test_parametrize.py tests/test_parity.py tests/test_masters_on_disk.py
    tests/test_offload_activations.py"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv
    python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
    nproc; free -g | head -2
} 2>&1 | tee -a "$OUT/run.log"

while [ $# -gt 0 ]; do
    stage=$1; shift
    echo "=== $stage $(date +%T)" | tee -a "$OUT/run.log"
    case $stage in
        cuda)  # cuda <seconds>: the cuda-marked tests of NEW_CUDA_TESTS only
            timeout "$1" python3 -m pytest -q -rfE -p no:cacheprovider -m cuda $NEW_CUDA_TESTS > "$OUT/pytest_cuda.log" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_cuda.log" | tail -n 60 | tee -a "$OUT/run.log"; shift ;;
        tests)  # tests <seconds>: the cuda-marked tests of NEW_CUDA_TESTS first (at most 240 s), then the suite
            timeout 240 python3 -m pytest -q -rfE -p no:cacheprovider -m cuda $NEW_CUDA_TESTS > "$OUT/pytest_cuda.log" 2>&1
            grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest_cuda.log" | tail -n 60 | tee -a "$OUT/run.log"
            timeout "$1" python3 -m pytest -q -rfE -p no:cacheprovider > "$OUT/pytest.log" 2>&1; shift
            grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -n 60 | tee -a "$OUT/run.log" ;;
        only)  # only "<pytest args>"
            timeout 300 python3 -m pytest -q -rfE -p no:cacheprovider $1 2>&1 | tail -n 200 | tee -a "$OUT/run.log"; shift ;;
        cast)
            timeout 120 python3 benchmarks/bench_cast.py --json "$OUT/cast.json" 2>&1 | tee -a "$OUT/run.log" ;;
        profile)
            timeout 240 python3 scripts/profile_memory.py --preset transformer --slices 2 4 --microbatches 1 2 \
                --checkpoint on --json "$OUT/profile.json" --plot "$OUT/profile.png" 2>&1 | tail -n 60 | tee -a "$OUT/run.log" ;;
        bench)  # bench "<presets>" <rss steps> <seconds> ["<more arguments>"]
            presets=$1; rss=$2; limit=$3; shift 3; more=""
            if [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; then more=$1; shift; fi
            timeout "$limit" python3 benchmarks/benchmark.py --preset $presets --rss-steps "$rss" $more --out-dir "$OUT" 2>&1 \
                | grep -v Warning | tail -n 80 | tee -a "$OUT/run.log" ;;
        maxmodel)  # maxmodel <cap GiB> <seconds> ["<more arguments>"]
            # Expandable segments unless the caller set the allocator: under a cap, memory left in
            # fragments fails a step that would fit (benchmarks/results/h100-2026-11-22, run 4).
            cap=$1; limit=$2; shift 2; more=""
            if [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; then more=$1; shift; fi
            PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} \
                timeout "$limit" python3 benchmarks/bench_max_model.py --cap-gib "$cap" $more --out-dir "$OUT" 2>&1 \
                | grep -v Warning | tail -n 80 | tee -a "$OUT/run.log" ;;
        storage)  # storage <seconds>: benchmarks/bench_storage.py in the system's temporary directory
            timeout "$1" python3 benchmarks/bench_storage.py --json "$OUT/storage.json" 2>&1 | tail -n 40 \
                | tee -a "$OUT/run.log"; shift ;;
        scale)  # scale <seconds> ["<more arguments>"]: benchmarks/bench_scale.py on the GPU
            limit=$1; shift; more=""
            if [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; then more=$1; shift; fi
            timeout "$limit" python3 benchmarks/bench_scale.py --device cuda $more --json "$OUT/scale.json" 2>&1 \
                | grep -v "^ " | tail -n 40 | tee -a "$OUT/run.log" ;;
        activations)  # activations <seconds> ["<more arguments>"]: benchmarks/bench_activations.py on the GPU
            limit=$1; shift; more=""
            if [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; then more=$1; shift; fi
            timeout "$limit" python3 benchmarks/bench_activations.py --device cuda $more \
                --json "$OUT/activations.json" 2>&1 | grep -v Warning | tail -n 40 | tee -a "$OUT/run.log" ;;
        schedule)  # schedule <seconds> ["<more arguments>"]: benchmarks/bench_schedule.py on the GPU (real matmuls),
                   # resident slices 1 and 2 of the 8 by default (--resident)
            limit=$1; shift; more=""
            if [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; then more=$1; shift; fi
            timeout "$limit" python3 benchmarks/bench_schedule.py --device cuda --dim 4096 --rows 512 --rounds 2 $more \
                --json "$OUT/schedule.json" 2>&1 | grep -v Warning | tail -n 40 | tee -a "$OUT/run.log" ;;
        pstep)  # pstep <case> <seconds>: torch.profiler tables of one case's offloaded step
            timeout "$2" python3 benchmarks/profile_step.py --case "$1" > "$OUT/profile_step_$1.txt" 2>&1
            head -n 40 "$OUT/profile_step_$1.txt" | tee -a "$OUT/run.log"; shift 2 ;;
        *) echo "unknown stage $stage" | tee -a "$OUT/run.log" ;;
    esac
done
echo "=== done $(date +%T)" | tee -a "$OUT/run.log"
