"""The wheel installs three top-level names, so the project installs beside any other package."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP_LEVEL = {"kernel_src", "tpu_kernel_records", "tpu_kernel_records_tools"}


def test_the_wheels_top_level_import_names_are_the_three(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--quiet", "--wheel-dir", str(tmp_path)],
                   cwd=REPO, check=True, capture_output=True, timeout=600)
    (wheel,) = tmp_path.glob("tpu_kernel_records-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {name.split("/")[0].removesuffix(".py") for name in names if ".dist-info/" not in name}
    assert top == TOP_LEVEL
    # what the tools need at run time travels in the wheel
    assert "tpu_kernel_records_tools/records/schemas/benchmark.schema.json" in names
    assert "tpu_kernel_records_tools/kaggle_runner/kernel-metadata.json" in names
    assert "kernel_src/flash/tpu.py" in names
