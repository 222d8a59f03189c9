"""What a CPU can check of ``scripts/device_check.sh`` (issue 56): its steps, the ``h100`` profile it measures, and
that ``build`` accepts a GPU run of that profile (a synthetic run: no GPU was lent to this project yet)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import release_fixtures as testing
from tpu_kernel_records_tools.bench.cases import build_cases, get_profile
from tpu_kernel_records_tools.builder.build import build

REPO = Path(__file__).resolve().parent.parent
H100 = get_profile("h100")


def _steps(venv: Path) -> dict[str, str]:
    out = subprocess.run([str(REPO / "scripts" / "device_check.sh"), "--dry-run"], capture_output=True, text=True,
                         check=True, env={**os.environ, "DEVICE_VENV": str(venv)}).stdout
    steps = [line.removeprefix("=== step ").split(": ", 1) for line in out.splitlines() if line.startswith("=== step")]
    return dict(steps)


def test_dry_run_lists_setup_grade_measure_build_in_order(tmp_path):
    steps = _steps(tmp_path / "venv")
    assert list(steps) == ["setup", "gpu", "grade-flash", "grade-paged", "measure", "build"]
    assert "'jax[cuda12]'" in steps["setup"] and "'.[dev]'" in steps["setup"]
    assert steps["gpu"].startswith(f"{tmp_path / 'venv'}/bin/python -c ")
    assert "--candidate flash --candidate pallas" in steps["grade-flash"] and "--quick" not in steps["grade-flash"]
    assert "--candidate paged-triton --paged" in steps["grade-paged"] and "--quick" not in steps["grade-paged"]
    run = steps["measure"].split("--out ")[1]
    assert "measure --profile h100" in steps["measure"] and run.startswith("runs/h100-")
    assert f"build {run} --data " in steps["build"] and "--data data" not in steps["build"]


def test_a_venv_with_the_project_is_not_set_up_again(tmp_path):
    script = tmp_path / "venv" / "bin" / "tpu-kernel-records"
    script.parent.mkdir(parents=True)
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    assert _steps(tmp_path / "venv")["setup"] == f"{tmp_path / 'venv'} is set up already"


def test_h100_profile_times_one_gpus_kernels_compiled_and_grades_them_fully():
    cases, pairs = build_cases(H100, H100.scopes, platform="gpu")
    assert H100.kernel_level == "full" and "sharded" not in H100.scopes
    assert {c.implementation for c in cases} == {"flash", "cudnn", "xla", "pallas", "paged-triton", "paged-xla",
                                                 "ragged-triton", "ragged-xla"}
    assert not any(c.interpret for c in cases)
    assert sorted({c.seq_len for c in cases if c.scope == "flash"}) == [1024, 2048, 8192]
    assert (len(cases), len(pairs)) == (86, 53)


@pytest.mark.slow  # a workspace and a build: about 20 s
# the synthetic run's scopes are those release_fixtures can fill (no model or paged fields): the build still checks
# every case of them against the h100 profile, on a gpu platform, compiled
def test_build_accepts_a_gpu_run_of_the_h100_profile(tmp_path, monkeypatch):
    monkeypatch.setattr(testing, "PROFILE", "h100")
    ws = testing.workspace(tmp_path / "ws")
    run = testing.write(ws / "runs", "synthetic-h100", platform="gpu", interpret=False,
                        device_kind="NVIDIA H100 80GB HBM3", scopes=("softmax", "attention", "flash"))
    build([run], ws / "data")
    env = json.loads((ws / "data" / "raw" / "synthetic-h100" / "environment.json").read_text())
    assert (env["platform"], env["profile"], env["interpret"]) == ("gpu", "h100", False)
