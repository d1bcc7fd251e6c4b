#!/usr/bin/env bash
# What a short GPU lease should answer, in one call of about 5 minutes of command time, each stage
# under its own time limit, its results merged into $OUT/summary.json as it ends (a killed run
# still leaves what it finished), a summary printed last. The default stages, in order:
#
#   (beside host and tests: the one-pass host update's kernel built for this machine and timed against
#           PyTorch's fused AdamW alone and followed by a cast, and clipped, multiplying the gradients
#           as it reads them against a scaling pass before it, benchmarks/host_kernels.py; ready
#           before slices, 150 s at most)
#   host    host facts: CPU model, cores, NUMA, transparent huge pages, host copy bandwidth at the
#           update's thread count, the pinned link each way (benchmarks/host_facts.py; ~10 s); then
#           the clip's norm over 3.54 GB of float32 gradients, offload's on several threads against
#           PyTorch's (benchmarks/bench_clipping.py; ~15 s, 40 s at most);
#   tests   the cuda-marked tests of what never ran on a GPU: resident slices, the trainers
#           (Trainer, Accelerate, Lightning moving an OffloadedCausalLM with .to("cuda"):
#           tests/test_trainer.py, tests/test_trainers_cuda.py), the
#           update in backward, the shadows staged from disk, 8-bit bases, one gradient copy per slice, the norms
#           computed in backward, any QLoRA or fused-host-pass test files present, the buffer
#           probe for buffers written unseen, jvp/jacfwd/vmap with the walk's loads outside the
#           transform, offloaded activations of recurrent layers (90 s);
#   slices  the 0.886 B Llama of benchmarks/bench_peers.py at 8 x 1024 tokens: resident; offload in
#           backward; the same with 9 of its 18 slices resident; the update behind the next forward
#           with clipping (as Hugging Face's Trainer runs it, the norms computed in backward); each beside the planner's prediction
#           for this machine (--predict), 3 timed steps after 2 warm-ups (150 s; the H200's
#           2026-11-28 second call took 84 s for 3 of these runs); then one more step of offload in
#           backward under the profiler, $OUT/trace-offload-in-backward.json.gz, and its per-stream
#           and per-host-thread table (benchmarks/stream_idle.py: the backward's thread paused 224 ms
#           in the 2026-11-28 trace while the one-pass kernel held Python's lock); then the rotary
#           tables sent once against at every boundary on a 16-layer Llama (benchmarks/bench_boundaries.py;
#           ~10 s, 40 s at most); then the walk's own time per slice on a 32-layer Llama of thin layers,
#           against the plain model and Hugging Face's gradient checkpointing (benchmarks/bench_walk.py;
#           ~10 s, 40 s at most);
#   exact   deterministic kernels, 2 layers: resident, offload, offload in backward, both with a
#           resident slice; every variant's gradients after the first backward against the resident
#           model's, and each slice's parameters after 4 steps, digest against every variant that
#           updated it on the same side (host or device) (50 s); then the same at the batch stage's
#           rows, resident and offload in backward with a resident slice (50 s);
#   batch   resident and offload in backward with 9 resident slices at 32 x 1024 tokens (16 x 1024
#           when the resident model does not fit), 2 timed steps after 2 warm-ups (90 s);
#   rest    the other cuda-marked tests, only while GPU_CHECK_BUDGET (360 s) has 30 s left.
#
# Opt-in (GPU_CHECK_STAGES, or --full for the default stages and these): threads (offload in
# backward with 9 resident slices at 8 x 1024 tokens: the update worker at 14 threads, OMP_WAIT_POLICY=PASSIVE,
# the pinned mappings on 4 KiB pages, each slice's gradients one copy per tensor, each in a process of
# its own, then fused AdamW over huge-page and 4 KiB mappings, benchmarks/bench_hugepages.py; on
# 2026-11-30 the four steps were 189-201 ms against 195 ms for the default: no lever; ~260 s), trace (one profiled step
# each of the resident model and of offload in backward: Chrome traces $OUT/trace-resident.json.gz,
# $OUT/trace-offload-in-backward.json.gz, and per CUDA stream the busy and idle time of forward and
# backward, benchmarks/stream_idle.py; 70 s; the H200's of 2026-11-28 are committed), peers (the
# settled comparison: offload, offload-sync, the resident variants, FSDP2, torchao, fairscale; 240 s),
# capped (a 4 GiB cap with AdamW's state in the disk tier; 120 s), suite (every cuda-marked test; 200 s).
#
#   bash benchmarks/gpu_check.sh                          # on the GPU machine, from the repository root
#   GPU_CHECK_STAGES="slices trace" bash benchmarks/gpu_check.sh    # some stages only
#   GPU_CHECK_STAGES="tests slices" GPU_CHECK_TESTS="tests/test_trainers_cuda.py" \
#       GPU_CHECK_RUNS="resident,offload-clip" bash benchmarks/gpu_check.sh   # a rerun of some tests and runs
#   bash benchmarks/gpu_check.sh --full                   # the default stages, then peers, capped, suite
#   bash benchmarks/gpu_check.sh --cpu-dry-run            # every stage at toy sizes on the CPU (CI runs it)
#
# What comes back (the device tool returns at most 8 files, 16 MiB each, 2 folders deep): $OUT/run.log
# (the headlines and the summary), $OUT/stages.log (every stage's full output), $OUT/pytest.log,
# $OUT/summary.json (every stage's JSON, one key per stage), and the traces (offload in backward's from
# the slices stage; with the trace stage, the resident model's too): 5 or 6 files. Stage JSONs
# are written to a scratch folder first and merged.
#
# The GPU machine (nvidia-h200: Python 3.12, torch 2.11, transformers 5.17, accelerate, lightning,
# peft, pytest-timeout; no network) lacks what must travel as wheels under .whl/, installed to
# /tmp/site when present: transformers 5.24.0 (pyproject.toml needs >= 5.20) and datasets (the Trainer
# tests; with its own missing needs: dill, multiprocess); for the opt-in peers, torchao and fairscale
# 0.4.13. Fetch them here (device README, "nvidia-h200"):
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: \
#       --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl transformers==5.24.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
#       trl==1.16.0
# (pure-Python wheels, about 16 MiB; their other needs, tokenizers 0.23, huggingface-hub, pyarrow, fsspec,
# pandas, jinja2, are on the machine: run.log's first lines list the versions it used; without trl the
# SFTTrainer test skips, as it did on 2026-11-28). For the QLoRA tests, bitsandbytes
# 0.50.2 (--platform manylinux_2_24_x86_64; 43 MB, most of it CUDA 11.8-12.8 and ROCm libraries the
# machine's CUDA 13 does not load: unpacked, those and their RECORD lines removed, zipped again it is 7 MB).
# then one call: run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=480): about
# 420 s of command time are expected (2026-11-30: host 23 s, tests 44, the kernel's build beside them,
# slices with its two small benchmarks 120, exact 40, batch ~100; the machine started in about 35 s),
# and the rest stage runs only while the 360 s budget has 30 s left. That leaves a lent machine's 15
# minutes room for one short rerun: GPU_CHECK_STAGES, GPU_CHECK_TESTS, GPU_CHECK_RUNS and GPU_CHECK_SKIP
# narrow it.
# The stages' limits: GPU_CHECK_LIMITS="20 90 150 90 50 70 100" (host tests slices batch exact trace threads).
set -uo pipefail
shopt -s nullglob
dry=0 full=0
for arg in "$@"; do
    case $arg in
        --cpu-dry-run) dry=1 ;;
        --full) full=1 ;;
        *) echo "gpu_check.sh: unknown argument $arg (--cpu-dry-run, --full)"; exit 2 ;;
    esac
done
OUT=${OUT:-gpu_out}
[ $dry = 1 ] && OUT=${OUT_DRY:-$(mktemp -d)}
mkdir -p "$OUT"
work=$(mktemp -d)  # the stages' own JSON files, merged into $OUT/summary.json
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ $dry = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
read -r limit_host limit_tests limit_slices limit_batch limit_exact limit_trace limit_threads \
    <<< "${GPU_CHECK_LIMITS:-20 90 150 90 50 70 100}"
budget=${GPU_CHECK_BUDGET:-360}
stages=${GPU_CHECK_STAGES:-host tests slices exact batch rest}
[ $full = 1 ] && stages="$stages threads trace peers capped suite"
# A dry run (CI) checks the opt-in threads stage's commands too, at toy sizes.
[ $dry = 1 ] && [ -z "${GPU_CHECK_STAGES:-}" ] && [ $full = 0 ] && stages="$stages threads"
FIRST_TESTS=(tests/test_resident_slices*.py tests/test_trainer.py tests/test_trainers_cuda.py tests/test_accelerate.py tests/test_lightning.py
             tests/test_update_in_backward*.py tests/test_*qlora*.py tests/test_one_pass.py tests/test_gradients_on_disk.py
             tests/test_shadows_on_disk.py tests/test_int8.py tests/test_memory.py::test_accumulation_over_backwards_adds_onto_earlier_gradients_exactly
             tests/test_mixed_precision.py::test_loads_move_half_the_bytes_and_gradients_arrive_in_float32
             tests/test_mixed_precision.py::test_a_slices_gradients_cast_on_the_device_leave_in_one_copy
             tests/test_backward_norms.py tests/test_scale_in_update.py
             tests/test_buffers_written_unseen.py tests/test_autograd_edges_microbatches.py tests/test_offload_activations.py)
# A rerun's narrower choice: GPU_CHECK_TESTS (test paths for the tests stage), GPU_CHECK_RUNS (the
# bench_peers runs of the slices and batch stages), GPU_CHECK_BATCH_RUNS (the batch stage's alone),
# GPU_CHECK_KERNEL_ARGS (benchmarks/host_kernels.py's, "--rounds 1 --threads all": the kernel built
# and checked, its timings not repeated).
[ -n "${GPU_CHECK_TESTS:-}" ] && read -ra FIRST_TESTS <<< "$GPU_CHECK_TESTS"
peers=${GPU_CHECK_PEERS:-resident,offload,offload-sync,offload-resident,offload-in-backward-resident,fsdp2,torchao,fairscale}
dry_flag="" big=32 many=9  # resident slices of the -resident runs: half the 18
[ $dry = 1 ] && { dry_flag="--cpu-dry-run"; big=4; many=2; }
slices_runs=${GPU_CHECK_RUNS:-"resident,offload-in-backward,offload-in-backward-resident$many,offload-clip"}
batch_runs=${GPU_CHECK_BATCH_RUNS:-${GPU_CHECK_RUNS:-"resident,offload-in-backward-resident$many"}}
status=0 started=$SECONDS
log() { echo "$*" | tee -a "$OUT/run.log"; }
headline() { grep -vE "Warning|warn\(|^\s|USDT|^\[W|^W[0-9]" "$1" | tail -n "$2" | tee -a "$OUT/run.log"; }
# stage <name> <limit> <command...>: runs it under its limit, its output appended to stages.log.
stage() {
    local name=$1 limit=$2; shift 2
    log "=== $name $(date +%T) (limit ${limit} s, ${SECONDS}s into the run)"
    echo "=== $name $(date +%T)" >> "$OUT/stages.log"
    timeout "$limit" "$@" > "$work/$name.log" 2>&1
    local rc=$?
    cat "$work/$name.log" >> "$OUT/stages.log"
    [ $rc = 0 ] || { log "--- $name exited $rc"; status=1; }
    merge
}
skipping() { [[ " ${GPU_CHECK_SKIP:-} " == *" $1 "* ]]; }
merge() { $PY benchmarks/gpu_check_summary.py merge "$work" "$OUT/summary.json" >> "$OUT/stages.log" 2>&1; }
pytest_cuda() {  # pytest_cuda <limit> <paths...>: the cuda-marked tests of paths (collected only in a dry run)
    local limit=$1; shift
    if [ $dry = 1 ]; then
        # Without a GPU they skip: collect them, so a selection or import error shows here, not there.
        $PY -m pytest --co -q -p no:cacheprovider -m cuda "$@" >> "$OUT/pytest.log" 2>&1 || status=1
    else
        local per_test=""
        $PY -c "import pytest_timeout" 2>/dev/null && per_test="--timeout 60"
        timeout "$limit" $PY -m pytest -q -rfE -p no:cacheprovider --continue-on-collection-errors $per_test \
            -m cuda "$@" >> "$OUT/pytest.log" 2>&1
    fi
    grep -E "^(FAILED|ERROR)|passed|failed|collected|tests? (ran|collected)|error" "$OUT/pytest.log" | tail -n 30 \
        | tee -a "$OUT/run.log"
}

{
    [ $dry = 0 ] && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv
    $PY -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, torch.version.cuda,
        'transformers', transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
    git log -1 --format='commit %h %s' 2>/dev/null
    $PY -m pip list 2>/dev/null | grep -iE '^(transformers|datasets|tokenizers|huggingface.hub|pyarrow|fsspec|accelerate|lightning|peft|trl|bitsandbytes|torchao|fairscale) ' 
} 2>&1 | tee -a "$OUT/run.log"
log "stages: $stages"
# The one-pass host update's kernel builds for this machine (tens of seconds of one core) beside the
# first stages, and is ready before the timed ones: benchmarks/host_kernels.py, its JSON "kernels".
$PY benchmarks/host_kernels.py $dry_flag ${GPU_CHECK_KERNEL_ARGS:-} --json "$work/kernels.json" > "$work/kernels.log" 2>&1 &
kernels_pid=$!
kernels_ready() {
    [ -n "$kernels_pid" ] || return 0
    local waited=0
    while kill -0 "$kernels_pid" 2>/dev/null && [ $waited -lt 150 ]; do sleep 1; waited=$((waited + 1)); done
    kill "$kernels_pid" 2>/dev/null
    wait "$kernels_pid" 2>/dev/null || log "--- kernels: benchmarks/host_kernels.py failed or ran past 150 s"
    kernels_pid=""
    echo "=== kernels" >> "$OUT/stages.log"; cat "$work/kernels.log" >> "$OUT/stages.log"
    headline "$work/kernels.log" 7
    merge
}

for name in $stages; do
    case $name in
        host)
            stage host "$limit_host" $PY benchmarks/host_facts.py $dry_flag --json "$work/host.json"
            headline "$work/host.log" 0
            # The clip's norm on several threads against PyTorch's one (3.54 GB of gradients).
            clip_sizes=""
            [ $dry = 1 ] && clip_sizes="--hidden 64 --layers 2 --intermediate 128 --vocab 256 --repeats 1"
            stage clipping 40 $PY benchmarks/bench_clipping.py $clip_sizes --json "$work/clipping.json"
            headline "$work/clipping.log" 1 ;;
        tests)
            log "=== tests $(date +%T): cuda-marked tests of ${FIRST_TESTS[*]}"
            echo "=== tests: ${FIRST_TESTS[*]}" >> "$OUT/pytest.log"
            pytest_cuda "$limit_tests" "${FIRST_TESTS[@]}" ;;
        slices)
            kernels_ready
            # One more step of offload in backward under the profiler: its trace's host-thread pauses
            # against the H200's of 2026-11-28, when the one-pass kernel held Python's lock
            # (benchmarks/stream_idle.py; the trace stage adds the resident model's).
            trace_slices=()
            [[ ",$slices_runs," == *",offload-in-backward,"* ]] && trace_slices=(--trace "$OUT" --trace-runs offload-in-backward)
            stage slices "$limit_slices" $PY benchmarks/bench_peers.py $dry_flag --predict --only "$slices_runs" \
                --steps 3 --warmup 2 "${trace_slices[@]}" --json "$work/slices.json"
            headline "$work/slices.log" 9
            # The rotary tables sent to the host and back once, against at every boundary (Note:
            # [Leaves that pass through]): the launching thread's time on a 16-layer Llama.
            # A rerun can leave out the two small stages below (GPU_CHECK_SKIP="boundaries walk").
            boundary_sizes="--rounds 9"
            [ $dry = 1 ] && boundary_sizes="--layers 3 --hidden 32 --seq-len 16 --rounds 2 --warmup 1"
            skipping boundaries || {
                stage boundaries 40 $PY benchmarks/bench_boundaries.py $boundary_sizes --json "$work/boundaries.json"
                headline "$work/boundaries.log" 4; }
            # The walk's own time per slice, where thin layers leave the device waiting on the
            # launching thread: against the plain model and Hugging Face's gradient checkpointing.
            walk_sizes="--rounds 9"
            [ $dry = 1 ] && walk_sizes="--layers 3 --hidden 32 --seq-len 8 --rounds 2 --warmup 1"
            skipping walk || {
                stage walk 40 $PY benchmarks/bench_walk.py $walk_sizes --json "$work/walk.json"
                headline "$work/walk.log" 6; } ;;
        batch)
            for rows in $big $((big / 2)); do
                stage batch "$limit_batch" $PY benchmarks/bench_peers.py $dry_flag --predict --batch "$rows" \
                    --only "$batch_runs" --steps 2 --warmup 2 --json "$work/batch.json"
                headline "$work/batch.log" 8
                # Smaller only when the resident baseline itself ran out of device memory.
                grep -q '"resident": "OutOfMemoryError' "$work/batch.json" 2>/dev/null || break
            done ;;
        threads)
            kernels_ready
            # Fewer update threads, then a passive OpenMP wait, each in a process of its own (the
            # policy is read when the OpenMP runtime starts).
            for threads in 14; do
                [ $dry = 1 ] && threads=1
                stage "threads$threads" "$limit_threads" $PY benchmarks/bench_peers.py $dry_flag --update-threads "$threads" \
                    --only "offload-in-backward-resident$many" --steps 3 --warmup 2 --json "$work/threads$threads.json"
                headline "$work/threads$threads.log" 4
                [ $dry = 1 ] && break
            done
            # A dry run checks the commands once (the runs below differ only in their environment).
            [ $dry = 1 ] && { stage hugepages 60 $PY benchmarks/bench_hugepages.py --params 4e6 --rounds 1 --steps 2 \
                --json "$work/hugepages.json"; headline "$work/hugepages.log" 3; continue; }
            OMP_WAIT_POLICY=PASSIVE stage threads-passive "$limit_threads" $PY benchmarks/bench_peers.py $dry_flag \
                --only "offload-in-backward-resident$many" --steps 3 --warmup 2 --json "$work/threads-passive.json"
            headline "$work/threads-passive.log" 4
            # The pinned mappings without transparent huge pages (the slices stage had them), and
            # the fused AdamW over huge-page mappings and 4 KiB ones.
            OFFLOAD_HUGEPAGES=0 stage hugepages-off "$limit_threads" $PY benchmarks/bench_peers.py $dry_flag \
                --only "offload-in-backward-resident$many" --steps 3 --warmup 2 --json "$work/hugepages-off.json"
            headline "$work/hugepages-off.log" 4
            # Each slice's gradients one copy per tensor (Note: [One copy per slice] in
            # offload/streams/gradients.py): the slices stage sent them one copy per slice.
            OFFLOAD_GRADIENT_GATHER=0 stage gather-off "$limit_threads" $PY benchmarks/bench_peers.py $dry_flag \
                --only "offload-in-backward-resident$many" --steps 3 --warmup 2 --json "$work/gather-off.json"
            headline "$work/gather-off.log" 4
            stage hugepages 90 $PY benchmarks/bench_hugepages.py --params 128e6 --rounds 2 --json "$work/hugepages.json"
            headline "$work/hugepages.log" 3 ;;
        exact)
            stage exact "$limit_exact" $PY benchmarks/bench_peers.py $dry_flag --deterministic --layers 2 \
                --only resident,offload,offload-in-backward,offload-resident,offload-in-backward-resident \
                --steps 2 --warmup 2 --json "$work/exact.json"
            headline "$work/exact.log" 8
            # The same at the batch stage's rows: on 2026-11-30 one of 147 gradients there differed
            # (1e-3 relative) without deterministic kernels, where 8 x 1024 was bit for bit.
            stage exact-batch "$limit_exact" $PY benchmarks/bench_peers.py $dry_flag --deterministic --layers 2 \
                --batch "$big" --only resident,offload-in-backward-resident --steps 2 --warmup 2 \
                --json "$work/exact-batch.json"
            headline "$work/exact-batch.log" 6 ;;
        trace)
            trace_flags="--steps 1 --warmup 2"
            stage trace "$limit_trace" $PY benchmarks/bench_peers.py $dry_flag --only resident,offload-in-backward \
                $trace_flags --trace "$OUT" --trace-runs resident,offload-in-backward --json "$work/trace.json"
            headline "$work/trace.log" 4 ;;
        rest)
            left=$((budget - (SECONDS - started)))
            if [ $dry = 1 ] || [ $left -ge 30 ]; then
                ignore=()
                for f in "${FIRST_TESTS[@]}"; do ignore+=("--ignore=$f"); done
                log "=== rest $(date +%T): the other cuda-marked tests (limit ${left} s)"
                echo "=== rest" >> "$OUT/pytest.log"
                # A dry run collects the cuda test files only: CI's own run of the suite collects the rest.
                rest=(tests)
                [ $dry = 1 ] && rest=(tests/test_cuda*.py)
                pytest_cuda "$left" "${ignore[@]}" "${rest[@]}"
            else
                log "=== rest: skipped, ${left} s of the ${budget} s budget left"
            fi ;;
        peers)
            stage peers 240 $PY benchmarks/bench_peers.py $dry_flag --predict --only "$peers" --json "$work/peers.json"
            headline "$work/peers.log" 14 ;;
        capped)
            tier=$(mktemp -d -p "$PWD" .gpu-check-tier-XXXX)  # on the disk: /tmp may be memory
            PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} stage capped 120 \
                $PY benchmarks/bench_peers.py $dry_flag --only offload,offload-in-backward --layers 8 --cap-gib 4 \
                --disk-tier "$tier" --steps 2 --warmup 1 --json "$work/capped.json"
            rm -rf "$tier"
            headline "$work/capped.log" 6 ;;
        suite)
            log "=== suite $(date +%T): every cuda-marked test (limit 200 s)"
            echo "=== suite" >> "$OUT/pytest.log"
            pytest_cuda 200 tests ;;
        *) log "unknown stage $name (host tests slices threads batch exact rest trace peers capped suite)"; status=1 ;;
    esac
done

kernels_ready  # when no timed stage waited for it
log "=== summary $(date +%T), ${SECONDS}s"
merge
$PY benchmarks/gpu_check_summary.py show "$OUT/summary.json" 2>&1 | tee -a "$OUT/run.log"
[ ${PIPESTATUS[0]} = 0 ] || status=1
rm -rf "$work"
log "=== done $(date +%T), exit $status"
# A dry run fails on any stage's failure: CI runs it so that the GPU run never fails on a script bug.
[ $dry = 1 ] && exit $status
exit 0
