#!/usr/bin/env bash
# Everything a short GPU lease should check, in one call of at most about 8 minutes, each stage
# under its own time limit, logs and JSON written under $OUT as each stage finishes (so a killed
# run still leaves what it finished), a summary table printed last:
#
#   1. the cuda-marked tests (all of them; 200 s);
#   2. one training step of a Llama-shaped model against its peers: resident, OffloadModel +
#      OffloadOptimizer (the update at step(), in backward, and waited for; at step() and in
#      backward with a quarter of the slices resident on the device), FSDP2 with
#      CPUOffloadPolicy, torchao's CPUOffloadOptimizer, fairscale's OffloadModel
#      (scripts/bench_peers.py; 240 s; the runs: GPU_CHECK_PEERS; on the H100 the first seven took
#      about 120 s, the two resident runs add about 40 s);
#   3. the same model over a 4 GiB device cap with AdamW's state in the disk tier, the update at
#      step() and in backward (120 s);
#   4. exactness under deterministic kernels: 2 layers, resident and offloaded (gradients after the
#      first backward, parameters after the last step; 60 s).
#
#   bash benchmarks/gpu_check.sh                 # on the GPU machine, from the repository root
#   bash benchmarks/gpu_check.sh --cpu-dry-run   # the same stages at toy sizes on the CPU (CI runs it)
#
# Wheels under .whl/ (transformers, peft, torchao, fairscale: the GPU machine has no network) are
# installed to /tmp/site first when present. The stages' limits: GPU_CHECK_LIMITS="140 240 120 60".
set -uo pipefail
dry=0
[ "${1:-}" = "--cpu-dry-run" ] && dry=1
OUT=${OUT:-gpu_out}
[ $dry = 1 ] && OUT=${OUT_DRY:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ $dry = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
read -r limit_tests limit_peers limit_capped limit_exact <<< "${GPU_CHECK_LIMITS:-140 240 120 60}"
peers=${GPU_CHECK_PEERS:-resident,offload,offload-in-backward,offload-sync,offload-resident,offload-in-backward-resident,fsdp2,torchao,fairscale}
status=0
log() { echo "$*" | tee -a "$OUT/run.log"; }

{
    [ $dry = 0 ] && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,power.limit --format=csv
    $PY -c "import sys, torch, transformers; print(sys.version.split()[0], 'torch', torch.__version__, torch.version.cuda,
        'transformers', transformers.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
    nproc; free -g | head -2; df -h /tmp | tail -1
} 2>&1 | tee -a "$OUT/run.log"

log "=== 1 cuda-marked tests $(date +%T)"
if [ $dry = 1 ]; then
    # Without a GPU they skip: collect them, so a selection or import error shows here, not there.
    $PY -m pytest --co -q -p no:cacheprovider -m cuda tests > "$OUT/pytest_cuda.log" 2>&1 || status=1
else
    per_test=""
    $PY -c "import pytest_timeout" 2>/dev/null && per_test="--timeout 90"
    timeout "$limit_tests" $PY -m pytest -q -rfE -p no:cacheprovider --continue-on-collection-errors $per_test \
        -m cuda tests > "$OUT/pytest_cuda.log" 2>&1
fi
grep -E "^(FAILED|ERROR)|passed|failed|collected|error" "$OUT/pytest_cuda.log" | tail -n 60 | tee -a "$OUT/run.log"

log "=== 2 peers $(date +%T)"
dry_flag=""
[ $dry = 1 ] && dry_flag="--cpu-dry-run"
timeout "$limit_peers" $PY scripts/bench_peers.py $dry_flag --only "$peers" --json "$OUT/peers.json" > "$OUT/peers.log" 2>&1 \
    || status=1
grep -vE "Warning|warn\(|^\s" "$OUT/peers.log" | tail -n 30 | tee -a "$OUT/run.log"

log "=== 3 over a 4 GiB cap, state in the disk tier $(date +%T)"
tier=$(mktemp -d -p "$PWD" .gpu-check-tier-XXXX)  # on the disk: /tmp may be memory
PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True} timeout "$limit_capped" \
    $PY scripts/bench_peers.py $dry_flag --only offload,offload-in-backward --layers 8 --cap-gib 4 --disk-tier "$tier" --steps 2 --warmup 1 \
    --json "$OUT/capped.json" > "$OUT/capped.log" 2>&1 || status=1
rm -rf "$tier"
grep -vE "Warning|warn\(|^\s" "$OUT/capped.log" | tail -n 12 | tee -a "$OUT/run.log"

log "=== 4 exactness under deterministic kernels $(date +%T)"
timeout "$limit_exact" $PY scripts/bench_peers.py $dry_flag --deterministic --layers 2 --only resident,offload,offload-in-backward \
    --steps 2 --warmup 2 --json "$OUT/exact.json" > "$OUT/exact.log" 2>&1 || status=1
grep -vE "Warning|warn\(|^\s" "$OUT/exact.log" | tail -n 8 | tee -a "$OUT/run.log"

log "=== summary $(date +%T)"
grep -E "passed|failed|collected" "$OUT/pytest_cuda.log" | tail -n 1 | tee -a "$OUT/run.log"
$PY - "$OUT" <<'SUMMARY' 2>&1 | tee -a "$OUT/run.log"
import json, os, sys
sys.path.insert(0, "scripts")
from bench_peers import table
for name in ("peers", "capped", "exact"):
    path = os.path.join(sys.argv[1], name + ".json")
    if os.path.exists(path):
        report = json.load(open(path))
        ours = report["runs"].get("offload", {})
        print(f"\n{name}: {report['device_name']}, {report['parameters'] / 1e9:.2f} B parameters, "
              f"{report['tokens_per_step']} tokens/step; link GB/s "
              f"{report['bandwidth_bytes_per_s']['host_to_device'] / 1e9:.1f} / {report['bandwidth_bytes_per_s']['device_to_host'] / 1e9:.1f}; "
              f"host update alone {report.get('host_update_alone_s')}; efficiency {ours.get('efficiency')}; "
              f"gradients {report.get('gradients_after_first_backward')}")
        print(table(report))
        # Resident slices are stepped by the device's AdamW, the others by the host's: compared apart.
        for kind, resident in (("streamed", False), ("with resident slices", True)):
            digests = {n: r["parameters_sha256_16"] for n, r in report["runs"].items()
                       if "parameters_sha256_16" in r and n.endswith("-resident") == resident}
            if digests:
                print(f"parameters after the run, per offloaded variant ({kind}): {digests}; "
                      f"all equal: {len(set(digests.values())) <= 1}")
    else:
        print(f"\n{name}: no report (the stage did not finish)")
SUMMARY
log "=== done $(date +%T), exit $status"
# A dry run fails on any stage's failure: CI runs it so that the GPU run never fails on a script bug.
[ $dry = 1 ] && exit $status
exit 0
