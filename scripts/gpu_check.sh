#!/usr/bin/env bash
# The checks to run on a machine with a CUDA GPU (issue 20.10), from anywhere:
#
#     scripts/gpu_check.sh [OUT_FOLDER]             # on the GPU machine, with its own python3
#     scripts/gpu_check.sh --cpu-dry-run [OUT]      # here: the same steps on virtual CPU devices
#                                                   (PYTHON=.venv/bin/python; checks the code, measures nothing)
#
# 1. pytest -m cuda                      (every cuda-marked test: among them two replicas on one GPU,
#                                         device_ids=[0, 0], against torch's, and a script's own
#                                         peaks under dptui run)
# 2. run-ahead: torch's DataParallel and dpengine's on a large Linear, with and without grad
#    (host time over device time: scripts/gpu_runahead.py)
# 3. dptui --headless --json on cuda:0, dp and ddp backends: forward_ms > 0, NVML names
# 4. dptui run examples/train_script.py on cuda:0: every step published (64)
# 5. python -m bench --gpu-only          (mlp, cnn; ResNet-50 bf16 on [0] and [0, 0]; NVML polling)
# Everything goes to OUT_FOLDER (default gpu-check-DATE): one file per step and summary.txt,
# whose last line says how many steps failed; the exit status is that number. About 4 minutes
# on one GPU: each step is cut off after its own limit.
#
# The GPU machine has CUDA torch and pytest but not textual: if `import textual` fails, the
# wheels in the repository's .whl/ folder are installed into a scratch folder first (no
# network needed). README.md ("Checking on a GPU") says which wheels to download into .whl/.
set -u

dry_run=0
if [ "${1:-}" = "--cpu-dry-run" ]; then
    dry_run=1
    shift
fi
repo=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-gpu-check-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
out=$(cd "$out" && pwd)
py=${PYTHON:-python3}
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
summary="$out/summary.txt"
: >"$summary"
failures=0
SCALE=1  # a dry run on the CPU is slower: it gets 4 times the limits
BUDGET=290  # seconds for all steps: the whole check stays under 5 minutes

say() { echo "$*" | tee -a "$summary"; }

# step NAME LIMIT_S COMMAND...: run it with its output in OUT/NAME.txt, note ok or FAIL.
step() {
    local name=$1 limit=$(($2 * SCALE))
    shift 2
    local began=$SECONDS
    if [ $((BUDGET - SECONDS)) -lt "$limit" ]; then
        limit=$((BUDGET - SECONDS))
    fi
    if [ "$limit" -lt 5 ]; then
        failures=$((failures + 1))
        say "FAIL  $name: not run, the ${BUDGET} s were used up"
        return
    fi
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.txt" 2>&1
    local code=$?
    local took=$((SECONDS - began))
    if [ "$code" -eq 0 ]; then
        say "ok    $name (${took} s)"
    else
        failures=$((failures + 1))
        [ "$code" -eq 124 ] && code="$code: cut off after $limit s"
        say "FAIL  $name (exit $code, ${took} s): see $name.txt"
    fi
    tail -n 5 "$out/$name.txt" | cut -c 1-160 | sed 's/^/      /' | tee -a "$summary"
}

if ! "$py" -c "import textual" 2>/dev/null; then
    if ls "$repo"/.whl/*.whl >/dev/null 2>&1; then
        site=$(mktemp -d)
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$repo"/.whl/*.whl \
            >"$out/wheels.txt" 2>&1 || { say "FAIL  installing .whl/ (see wheels.txt)"; exit 1; }
        export PYTHONPATH="$repo:$site"  # the wheels before the machine's own (its rich may be older)
    else
        say "FAIL  textual is not importable and there is no .whl/ folder: see README.md, Checking on a GPU"
        exit 1
    fi
fi

{
    date -u
    "$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
              "cuda", torch.version.cuda, "gpus", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])'
    command -v nvidia-smi >/dev/null && nvidia-smi -L
} >"$out/environment.txt" 2>&1
say "environment: $(head -n 2 "$out/environment.txt" | tail -n 1)"

if [ "$dry_run" -eq 1 ]; then
    SCALE=4
    BUDGET=$((BUDGET * SCALE))
    devices=cpu:0,cpu:1
    nvml=
    dry=--cpu-dry-run
    export BENCH_GPU_DRYRUN=1
    bench_quick=--quick
else
    devices=cuda:0
    nvml=--nvml
    dry=
    bench_quick=
    if ! "$py" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
        say "FAIL  torch sees no CUDA device (run with --cpu-dry-run to try the steps on the CPU)"
        exit 1
    fi
fi

# 1. Every cuda-marked test (they skip cleanly in a dry run: this checks that they collect).
step pytest-cuda 120 "$py" -m pytest -q -m cuda -p no:cacheprovider --junitxml="$out/pytest-cuda.xml"

# 2. Run-ahead.
step runahead 45 "$py" scripts/gpu_runahead.py $dry "$out/runahead.json"

# 3. The trainer on the GPU, both backends; telemetry often, so that NVML samples come.
for backend in dp ddp; do
    starts=
    [ "$backend" = dp ] && starts=--starts  # a DataParallel step's phases start where its events say
    step "dptui-$backend" 45 "$py" -m tui.cli --headless --json --backend "$backend" --devices "$devices" \
        --model mlp --epochs 3 --seed 1 --telemetry-interval 0.2 --log "$out/dptui-$backend.jsonl"
    step "dptui-$backend-events" 15 "$py" scripts/gpu_events_check.py "$out/dptui-$backend.jsonl" $nvml $starts
done

# 4. A user's script: 2048 samples, batch 64, 2 epochs: 64 steps, every one published.
step dptui-run 45 "$py" -m tui.cli run --headless --devices "$devices" --log "$out/dptui-run.jsonl" \
    examples/train_script.py --epochs 2
step dptui-run-events 15 "$py" scripts/gpu_events_check.py "$out/dptui-run.jsonl" --steps 64 --starts $nvml

# 5. The GPU benchmark (dpengine against torch's DataParallel, NVML polling cost).
step bench-gpu 140 "$py" -m bench --gpu-only $bench_quick --out "$out/bench-gpu.md"

say "$failures of 11 steps failed; results in $out"
exit "$failures"
