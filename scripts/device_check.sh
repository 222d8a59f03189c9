#!/usr/bin/env bash
# The device check (issue 56): on a machine with one NVIDIA GPU and nothing else installed, from the repository
# root: set up a venv with JAX's CUDA wheels, grade the GPU kernels at the full level, run
# `measure --profile h100` and build the run into a scratch copy of data/ (the checkout's data/ is untouched).
# Prints each step's wall time; the run folder is left in runs/. Meant to finish within 10 minutes.
#   scripts/device_check.sh            run it
#   scripts/device_check.sh --dry-run  print the steps' commands only (what tests/test_device_check.py reads)
# DEVICE_VENV=DIR uses that venv (default .venv-device); one that already has the project is not set up again.
set -euo pipefail
cd "$(dirname "$0")/.."
dry=${1:-}
venv=${DEVICE_VENV:-.venv-device}
run_id=h100-$(date -u +%Y%m%dt%H%M%Sz)
scratch=${TMPDIR:-/tmp}/device-check-$run_id
start=$SECONDS

step() {  # step NAME COMMAND...: run it (or print it with --dry-run) and print its wall time
  local name=$1 t0=$SECONDS; shift
  echo "=== step $name: $*"
  [ "$dry" = "--dry-run" ] && return 0
  "$@"
  echo "=== step $name: $((SECONDS - t0)) s"
}

[ "$dry" = "--dry-run" ] || mkdir -p "$scratch"
if [ -x "$venv/bin/tpu-kernel-records" ]; then  # set up before (a machine without the package index)
  echo "=== step setup: $venv is set up already"
else
  step setup bash -c "python3 -m venv $venv && $venv/bin/python -m pip install -q -e '.[dev]' 'jax[cuda12]'"
fi
step gpu "$venv/bin/python" -c "import jax; assert jax.default_backend() == 'gpu', jax.devices(); print(jax.devices())"
step grade-flash "$venv/bin/tpu-kernel-rubric" --candidate flash --candidate pallas --json "$scratch/grade-flash.json"
step grade-paged "$venv/bin/tpu-kernel-rubric" --candidate paged-triton --paged --json "$scratch/grade-paged.json"
step measure "$venv/bin/tpu-kernel-records" measure --profile h100 --out "runs/$run_id"
step build bash -c "cp -r data dataset_card.md $scratch/ && $venv/bin/tpu-kernel-records build runs/$run_id --data $scratch/data --quiet"
echo "=== device check: $((SECONDS - start)) s in all; run folder runs/$run_id"
