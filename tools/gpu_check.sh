#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one run: the GPU's name and the precision training will use,
# the CUDA tests, then every notebook 00-12 executed with its GPU setting (pick_setting picks it by
# itself on CUDA), each on a copy with a time limit, and a table of the seconds each took beside
# the FLOP-budget estimate for a T4 (tools/t4_estimates.py). Logs and the executed notebooks go to
# $OUT (default build/gpu); the table also goes to $OUT/notebooks.log, for the README.
#
#     bash tools/gpu_check.sh                          # on a machine with a GPU, package installed
#     NOTEBOOKS="06 08" PER_NOTEBOOK=300 bash tools/gpu_check.sh
#
# ALLOW_CPU=1 runs it on a machine without a GPU (to try the script: notebooks take their CPU setting).
# Exit status 1 if there is no CUDA GPU (and no ALLOW_CPU=1), a CUDA test fails or a notebook fails or runs out of time.
# Nothing here runs in CI, which has no GPU.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu}
PYTHON=${PYTHON:-python3}
PER_NOTEBOOK=${PER_NOTEBOOK:-300}   # seconds each notebook may take (the budget is 180 s of training)
NOTEBOOKS=${NOTEBOOKS:-"00 01 02 03 04 05 06 06a 07 07a 08 08a 08b 09 10 11 12"}
export MPLBACKEND=Agg PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$OUT/notebooks"

"$PYTHON" - <<'EOF' | tee "$OUT/gpu.txt" || exit 1
import os
import sys

import torch
from tutorial_lib.device import describe, pick_device
if not torch.cuda.is_available() and os.environ.get("ALLOW_CPU") != "1":
    sys.exit("no CUDA GPU here: nothing to check (the FLOP estimates: python tools/t4_estimates.py)")
print("GPU:", torch.cuda.get_device_name() if torch.cuda.is_available() else "none", "| torch", torch.__version__, "| CUDA", torch.version.cuda)
print("running on", describe(pick_device()))
EOF

status=0
if [ "${RUN_TESTS:-1}" = 1 ]; then
    "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda.py tests/test_gpu_settings.py \
        tests/test_train_gpu_loop.py tests/test_t4_budget.py 2>&1 | tee "$OUT/cuda_tests.log" || status=1
fi

"$PYTHON" tools/t4_estimates.py > "$OUT/t4_estimates.txt" || status=1
: > "$OUT/notebooks.log"
for n in $NOTEBOOKS; do
    src=$(ls notebooks/${n}_*.ipynb 2>/dev/null | head -1)
    if [ -z "$src" ]; then echo "notebook $n: not found" | tee -a "$OUT/notebooks.log"; status=1; continue; fi
    copy=$OUT/notebooks/$(basename "$src")
    cp "$src" "$copy"
    start=$(date +%s.%N)
    if timeout "$PER_NOTEBOOK" "$PYTHON" tools/execute_notebooks.py --timeout "$PER_NOTEBOOK" "$copy" \
            >> "$OUT/notebook_runs.log" 2>&1; then
        result=passed
    else
        result="FAILED (exit $?)"; status=1
    fi
    seconds=$("$PYTHON" -c "print(f'{$(date +%s.%N) - $start:.0f}')")
    estimate=$(awk -v nb="$(basename "$src")" '$1 == nb {print ($NF == "s") ? $(NF-1) " s" : "none"}' \
        "$OUT/t4_estimates.txt")
    echo "notebook $n: $result in $seconds s (whole notebook; T4 training estimate: ${estimate:-none})" \
        | tee -a "$OUT/notebooks.log"
done
echo "GPU: $(head -1 "$OUT/gpu.txt" | sed 's/^GPU: //')" | tee -a "$OUT/notebooks.log"
exit $status
