#!/usr/bin/env bash
# The checks that need a CUDA GPU, as one short run: the CUDA tests, then every notebook
# executed with its GPU setting (pick_setting picks it by itself). Each notebook is executed
# on a copy, with a time limit; the logs and the executed training notebooks go to $OUT
# (default build/gpu).
#
#     bash tools/gpu_check.sh              # on a machine with a GPU and the package installed
#
# Nothing here runs in CI, which has no GPU.
set -u -o pipefail
OUT=${OUT:-build/gpu}
mkdir -p "$OUT"
export MPLBACKEND=Agg PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}
PER_NOTEBOOK=${PER_NOTEBOOK:-150}   # seconds each notebook may take
NOTEBOOKS=${NOTEBOOKS:-"06 08 04 05 00 03 02 01 07"}

"$PYTHON" -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '|', torch.cuda.get_device_name())"
if [ "${RUN_TESTS:-1}" = 1 ]; then
    "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda.py tests/test_gpu_settings.py 2>&1 | tee "$OUT/cuda_tests.log"
fi

mkdir -p build/gpu_notebooks
status=0
for n in $NOTEBOOKS; do
    src=$(ls notebooks/${n}_*.ipynb)
    copy=build/gpu_notebooks/$(basename "$src")
    cp "$src" "$copy"
    start=$(date +%s)
    if timeout "$PER_NOTEBOOK" "$PYTHON" tools/execute_notebooks.py --timeout "$PER_NOTEBOOK" "$copy" >> "$OUT/notebook_runs.log" 2>&1; then
        result=passed
    else
        result="FAILED (exit $?)"; status=1
    fi
    echo "notebook $n: $result in $(( $(date +%s) - start )) s" | tee -a "$OUT/notebooks.log"
    case $n in 04|05|06|08) cp "$copy" "$OUT/" ;; esac   # the executed training notebooks come back
done
exit $status
