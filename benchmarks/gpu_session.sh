#!/usr/bin/env bash
# The GPU checks, as one prepared script for a lent GPU machine (its own torch and Lightning, nothing installed).
#
#     OUT=/some/folder bash benchmarks/gpu_session.sh
#
# Runs, each under its own time limit, writing one log per step to $OUT:
#   1. env.txt        versions of what the code relies on, and nvidia-smi;
#   2. gpu_tests.log  the GPU-marked tests (`pytest -m gpu`);
#   3. throughput.log `benchmarks/train_throughput.py --device cuda` (ours against Hugging Face's RoFormer), alone;
#   4. demo.log       `python -m pipelines.demo` end to end, accelerator=auto (so training on the GPU), beside
#   5. suite.log      the CPU-marked suite on the same host with CUDA visible (`pytest -m "not gpu"`).
# The demo's metrics.json and run summary are copied to $OUT too. Steps 4 and 5 share the host, so the demo's
# stage times there are upper bounds; steps 2 and 3 run alone. The whole script takes about 9 minutes on an H100
# (session 34; about 8 with DEMO_LIMIT=1, session 36): within one call's 10 minutes and a session's 15 minutes of device time, with no time to rerun.
# The suite runs at `-vv` (the project's addopts hold -q): each test's outcome is logged as it ends, so a limit
# that cuts the run still names the failures so far.
set -u
OUT=${OUT:?set OUT to a folder for the logs}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" MPLBACKEND=Agg
PY=${PY:-python3}
mkdir -p "$OUT"

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PY" - <<'EOF'
import importlib
for name in ("torch", "pytorch_lightning", "numpy", "pandas", "pyarrow", "sklearn", "matplotlib", "transformers"):
    try:
        print(name, importlib.import_module(name).__version__)
    except ImportError as error:
        print(name, "missing:", error)
import torch
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
EOF
    nproc
} >"$OUT/env.txt" 2>&1

# Modules whose optional extra the GPU image lacks (meds, ray) are left out by the root conftest.py; they read
# files only and run in CI.
IGNORE=(-p no:cacheprovider)

timeout "${GPU_TESTS_LIMIT:-100}" "$PY" -m pytest -m gpu "${IGNORE[@]}" -q -rs tests/test_gpu.py tests/test_pretrain.py \
    >"$OUT/gpu_tests.log" 2>&1
echo "rc=$?" >>"$OUT/gpu_tests.log"

timeout "${THROUGHPUT_LIMIT:-100}" "$PY" benchmarks/train_throughput.py --device cuda --rounds 2 >"$OUT/throughput.log" 2>&1
echo "rc=$?" >>"$OUT/throughput.log"

DEMO=$(mktemp -d)/demo
(
    started=$SECONDS
    timeout "${DEMO_LIMIT:-450}" "$PY" -m pipelines.demo --out "$DEMO" >"$OUT/demo.log" 2>&1
    echo "rc=$? wall_s=$((SECONDS - started))" >>"$OUT/demo.log"
    cp "$DEMO"/finetune/metrics.json "$OUT/finetune_metrics.json" 2>/dev/null
    cp "$DEMO"/evaluate/metrics.json "$OUT/evaluate_metrics.json" 2>/dev/null
) &
started_suite=$SECONDS
timeout "${SUITE_LIMIT:-420}" "$PY" -m pytest -m "not gpu" "${IGNORE[@]}" -vv -rfE -n 8 --dist loadfile \
    >"$OUT/suite.log" 2>&1
echo "rc=$? wall_s=$((SECONDS - started_suite))" >>"$OUT/suite.log"
wait
