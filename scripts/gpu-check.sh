#!/usr/bin/env bash
# Verify the appliance on an NVIDIA GPU box in one call, then print one summary table (exit 0: every check passed).
#
#   scripts/gpu-check.sh
#
# 1. the GPU: nvidia-smi lists one;
# 2. the CUDA build: APPLIANCE_GPU=cuda scripts/setup.sh rebuilds llama-cpp-python with CUDA (for this GPU's
#    architecture only, -DCMAKE_CUDA_ARCHITECTURES=native, unless CMAKE_ARGS says otherwise) and checks that it
#    offloads; it needs the CUDA toolkit (nvcc; /usr/local/cuda/bin is tried) and PyPI (or PIP_NO_INDEX=1
#    PIP_FIND_LINKS=<folder with the llama-cpp-python sdist>);
# 3. the GPU tests, pytest -m gpu (tests/test_gpu.py, tests/test_devices.py): the NVML device against nvidia-smi, the
#    ledger's estimate of a fully offloaded model against the VRAM nvidia-smi measures, n_gpu_layers auto under a
#    lowered admission_percent, a KV swap out of VRAM and back;
# 4. the KV swap benchmark with every layer on the GPU (python -m benchmarks.kv_swap --quick --n-gpu-layers -1);
# 5. the layer-streaming benchmark's GPU path (python -m benchmarks.layer_stream --quick --device cuda), which is
#    written for PyTorch: PyTorch is installed into .venv first when it is missing (its CUDA wheels are a few GB).
#
# Meant to take under 10 minutes on a 16-core GPU machine (not yet timed on one), most of it the CUDA build (skipped
# when .venv already has one). Logs and results go to GPU_CHECK_DIR (default: a new folder under /tmp, printed); the
# benchmarks' recorded results in benchmarks/results/ are left alone.
set -uo pipefail
cd "$(dirname "$0")/.."
work=${GPU_CHECK_DIR:-$(mktemp -d /tmp/gpu-check.XXXXXX)}
mkdir -p "$work"
steps="$work/steps.tsv"
: >"$steps"
report="$work/gpu-report.jsonl"
: >"$report"
py=.venv/bin/python
export PYTHONUNBUFFERED=1

record() {  # record <check> <PASS|FAIL|SKIP> <seconds> <detail>
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(printf '%s' "$4" | tr '\t\n' '  ' | cut -c1-160)" >>"$steps"
    echo "gpu-check: $1: $2 ($3 s) $4" >&2
}
since() { echo $(( $(date +%s) - $1 )); }

# 1. the GPU
start=$(date +%s)
if ! command -v nvidia-smi >/dev/null 2>&1 || ! gpus=$(nvidia-smi -L 2>&1) || [ -z "$gpus" ]; then
    record "NVIDIA GPU" FAIL "$(since "$start")" "nvidia-smi is missing or lists no GPU: nothing to check here"
    gpu_ok=0
else
    record "NVIDIA GPU" PASS "$(since "$start")" "$(printf '%s' "$gpus" | head -n 1)"
    gpu_ok=1
fi

# 2. the CUDA build
if [ "$gpu_ok" = 1 ]; then
    start=$(date +%s)
    if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
        export PATH="/usr/local/cuda/bin:$PATH"
    fi
    if APPLIANCE_GPU=cuda CMAKE_ARGS="${CMAKE_ARGS:--DCMAKE_CUDA_ARCHITECTURES=native}" scripts/setup.sh run \
            >"$work/setup.log" 2>&1; then
        record "CUDA build of llama-cpp-python" PASS "$(since "$start")" "$("$py" -m appliance.engine.gpubuild 2>&1)"
        build_ok=1
    else
        record "CUDA build of llama-cpp-python" FAIL "$(since "$start")" \
            "$(tail -n 1 "$work/setup.log") (log: $work/setup.log)"
        build_ok=0
    fi
else
    build_ok=0
fi

# 3. the GPU tests
if [ "$build_ok" = 1 ]; then
    start=$(date +%s)
    if ! "$py" -c 'import pytest' 2>/dev/null; then
        "$py" -m pip install --quiet --progress-bar off pytest >>"$work/setup.log" 2>&1
    fi
    APPLIANCE_GPU_REPORT="$report" timeout 420 "$py" -m pytest -m gpu -p no:randomly -p no:cacheprovider -rA \
        --junitxml="$work/gpu-tests.xml" tests/test_gpu.py tests/test_devices.py >"$work/gpu-tests.log" 2>&1
    status=$?
    summary=$(grep -E '^=+ .*(passed|failed|skipped|error).* =+$' "$work/gpu-tests.log" | tail -n 1 | tr -d '=')
    if [ "$status" = 0 ]; then  # each test's row below says what it measured, or why it skipped
        record "pytest -m gpu" PASS "$(since "$start")" "$summary"
    else
        record "pytest -m gpu" FAIL "$(since "$start")" "${summary:-exit $status} (log: $work/gpu-tests.log)"
    fi
fi

# 4. the KV swap benchmark on the GPU
if [ "$build_ok" = 1 ]; then
    start=$(date +%s)
    if timeout 300 "$py" -m benchmarks.kv_swap --quick --n-gpu-layers -1 --out "$work/kv_swap.json" \
            >"$work/kv_swap.log" 2>&1; then
        record "KV swap benchmark, GPU" PASS "$(since "$start")" "$(grep '^HEADLINE' "$work/kv_swap.log")"
    else
        record "KV swap benchmark, GPU" FAIL "$(since "$start")" \
            "$(tail -n 1 "$work/kv_swap.log") (log: $work/kv_swap.log)"
    fi
fi

# 5. the layer-streaming benchmark's GPU path (PyTorch)
if [ "$gpu_ok" = 1 ] && [ -x "$py" ]; then
    start=$(date +%s)
    torch_ok=1
    if ! "$py" -c 'import torch' 2>/dev/null; then
        echo "gpu-check: installing PyTorch into .venv for the layer-streaming benchmark's GPU path" >&2
        if ! timeout 600 "$py" -m pip install --progress-bar off torch >"$work/torch.log" 2>&1; then
            record "layer streaming, GPU path" FAIL "$(since "$start")" \
                "PyTorch could not be installed: $(tail -n 1 "$work/torch.log")"
            torch_ok=0
        fi
    fi
    if [ "$torch_ok" = 1 ]; then
        if timeout 300 "$py" -m benchmarks.layer_stream --quick --device cuda --out "$work/layer_stream.json" \
                >"$work/layer_stream.log" 2>&1; then
            record "layer streaming, GPU path" PASS "$(since "$start")" "$(grep '^HEADLINE' "$work/layer_stream.log")"
        else
            record "layer streaming, GPU path" FAIL "$(since "$start")" \
                "$(tail -n 1 "$work/layer_stream.log") (log: $work/layer_stream.log)"
        fi
    fi
fi

# The summary: every step, then each GPU test with the figures it reported.
summary_python=$py
[ -x "$summary_python" ] || summary_python=python3
"$summary_python" - "$steps" "$work/gpu-tests.xml" "$report" "$work" <<'PYTHON'
import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

steps_file, junit_file, report_file, work = (Path(arg) for arg in sys.argv[1:5])
rows = [line.split("\t") for line in steps_file.read_text().splitlines() if line]
figures = {}
for line in report_file.read_text().splitlines() if report_file.exists() else []:
    entry = json.loads(line)
    figures[entry.pop("test")] = entry
MIB = 1024 * 1024


def said(name, entry):
    """A test's figures in a few words."""
    if "tight" in entry:
        return (f"admission_percent 90: {entry['roomy']} layers on the GPU; {entry['admission_percent']}: "
                f"{entry['tight']} (free {entry['cap_bytes'] / MIB:.1f} MiB, ledger {entry['ledger_bytes'] / MIB:.1f}"
                f" MiB, nvidia-smi {entry['measured_bytes'] / MIB:.1f} MiB)")
    if "ratio" in entry:
        return (f"{entry['gpu_layers']} layers: ledger {entry['ledger_bytes'] / MIB:.1f} MiB, nvidia-smi "
                f"({entry['measured_by']}) {entry['measured_bytes'] / MIB:.1f} MiB = {entry['ratio']:.3f} of it; "
                f"offloaded blocks {entry['blocks_bytes'] / MIB:.1f} MiB")
    if "nvml_total" in entry:
        smi = entry["smi"]
        return (f"NVML used/free {entry['nvml_used'] / MIB:.0f}/{entry['nvml_free'] / MIB:.0f} MiB, nvidia-smi "
                f"{smi['used'] / MIB:.0f} (+{smi['reserved'] / MIB:.0f} reserved)/{smi['free'] / MIB:.0f} MiB")
    if "kv_swap_bytes" in entry:
        return f"{entry['gpu_layers']} layers on the GPU, {entry['kv_swap_bytes']} bytes swapped, tokens equal"
    return ""


if junit_file.exists():
    for case in ElementTree.parse(junit_file).getroot().iter("testcase"):
        name = case.get("name", "")
        outcome = "PASS"
        detail = said(name, figures.get(name, {}))
        for tag, verdict in (("failure", "FAIL"), ("error", "FAIL"), ("skipped", "SKIP")):
            found = case.find(tag)
            if found is not None:
                outcome = verdict
                detail = (found.get("message") or "").splitlines()[0][:160] if (found.get("message") or "") else detail
        rows.append([f"  {case.get('classname', '').rpartition('.')[2]}::{name}", outcome,
                     f"{float(case.get('time', 0)):.0f}", detail])
width = max(len(row[0]) for row in rows) if rows else 10
print()
print(f"{'check':<{width}}  {'result':<6}  {'s':>4}  detail")
print(f"{'-' * width}  {'-' * 6}  {'-' * 4}  {'-' * 40}")
for check, outcome, seconds, detail in rows:
    print(f"{check:<{width}}  {outcome:<6}  {seconds:>4}  {detail}")
failed = [row for row in rows if row[1] == "FAIL"]
print(f"\n{len(failed)} failed; logs and results in {work}")
sys.exit(1 if failed or not rows else 0)
PYTHON
