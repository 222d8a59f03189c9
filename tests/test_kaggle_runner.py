"""The Kaggle runner's logic on the CPU: pip, the TPU smoke test and the measure job are injected.

Nothing here reaches Kaggle, PyPI or a TPU; the real steps run only on a Kaggle TPU worker.
"""

from __future__ import annotations

import json
import os
from importlib import metadata
from pathlib import Path

import jsonschema
import pytest

from tpu_kernel_records_tools.records import rawio
from tpu_kernel_records_tools.kaggle_runner import run_kaggle as rk

KAGGLE_DIR = Path(rk.__file__).parent
BOOTSTRAP_ITEMS = rawio.load_schema("environment")["properties"]["bootstrap"]


class FakeImage:
    """A Kaggle image: what pip installs, which versions are then present, whether Pallas runs."""

    def __init__(self, smoke_passes_for=("0.6.2",), install_fails_for=()):
        self.installed = {"jax": "0.5.0", "jaxlib": "0.5.0", "libtpu": "0.0.15"}
        self.smoke_passes_for, self.install_fails_for = smoke_passes_for, install_fails_for
        self.pip_calls, self.measured = [], []

    def install(self, args):
        self.pip_calls.append(list(args))
        if any(bad in args for bad in self.install_fails_for):
            raise rk.StepFailed("ERROR: No matching distribution found")
        if "jax" in args and "--upgrade" in args:
            self.installed.update(jax="0.10.2", jaxlib="0.10.2")
        if "jax[tpu]==0.6.2" in args:
            self.installed.update(jax="0.6.2", jaxlib="0.6.2", libtpu="0.0.17")

    def probe(self):
        return dict(self.installed)

    def smoke(self):
        if self.installed["jax"] not in self.smoke_passes_for:
            raise rk.StepFailed("Mosaic: the kernel was serialized by a newer version than libtpu supports")

    def measure(self, workdir, bootstrap_file):
        self.measured.append((workdir, json.loads(bootstrap_file.read_text())))
        return 0

    def main(self, workdir, **overrides):
        kwargs = dict(workdir=workdir, install=self.install, probe=self.probe, smoke=self.smoke,
                      locate=lambda: "/kaggle/input/src/tpu_kernel_records-0.1.0-py3-none-any.whl",
                      measure=self.measure, log=lambda line: None)
        return rk.main([], **{**kwargs, **overrides})


def _valid(records):
    for record in records:
        jsonschema.validate(record, BOOTSTRAP_ITEMS["items"])


def test_newest_rejected_then_0_6_2_used(tmp_path):
    image = FakeImage()
    assert image.main(tmp_path) == 0
    records = json.loads((tmp_path / "bootstrap.json").read_text())
    _valid(records)
    assert [(r["jax"], r["libtpu"], r["outcome"]) for r in records] == [
        ("0.10.2", "0.0.15", "rejected"), ("0.6.2", "0.0.17", "used")]
    assert "newer version than libtpu" in records[0]["error"] and records[1]["error"] is None
    # the project goes in without dependencies, after the JAX was chosen, and measure sees the attempts
    assert image.pip_calls[-2:] == [list(rk.PROJECT_DEPS),
                                    ["--no-deps", "/kaggle/input/src/tpu_kernel_records-0.1.0-py3-none-any.whl"]]
    assert image.measured == [(tmp_path, records)]


def test_newest_is_kept_when_its_smoke_test_passes(tmp_path):
    image = FakeImage(smoke_passes_for=("0.10.2", "0.6.2"))
    assert image.main(tmp_path) == 0
    records = json.loads((tmp_path / "bootstrap.json").read_text())
    assert [(r["jax"], r["outcome"]) for r in records] == [("0.10.2", "used")]
    assert not any("jax[tpu]==0.6.2" in call for call in image.pip_calls)


def test_a_failed_install_is_recorded_and_the_next_attempt_runs(tmp_path):
    image = FakeImage(install_fails_for=("--upgrade",))
    assert image.main(tmp_path) == 0
    records = json.loads((tmp_path / "bootstrap.json").read_text())
    _valid(records)
    assert [r["outcome"] for r in records] == ["failed", "used"]
    assert "No matching distribution" in records[0]["error"]


def test_no_working_jax_means_no_measurement(tmp_path):
    image = FakeImage(smoke_passes_for=())
    assert image.main(tmp_path) == 1
    records = json.loads((tmp_path / "bootstrap.json").read_text())
    _valid(records)
    assert [r["outcome"] for r in records] == ["rejected", "rejected"]
    assert image.measured == [] and ["--no-deps"] not in [c[:1] for c in image.pip_calls]


def test_a_missing_project_stops_before_any_install(tmp_path):
    image = FakeImage()
    def locate():
        raise rk.StepFailed("project not found")
    assert image.main(tmp_path, locate=locate) == 2
    assert image.pip_calls == [] and not (tmp_path / "bootstrap.json").exists()


def test_find_project_prefers_the_explicit_spec_then_a_wheel(tmp_path):
    assert rk.find_project(tmp_path, {rk.PROJECT_ENV: "git+https://example.invalid/x"}) == "git+https://example.invalid/x"
    with pytest.raises(rk.StepFailed, match="project not found"):
        rk.find_project(tmp_path, {})
    (tmp_path / "ds").mkdir()
    wheel = tmp_path / "ds" / "tpu_kernel_records-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    assert rk.find_project(tmp_path, {}) == str(wheel)


def test_run_python_reports_failures_with_their_output():
    assert rk.run_python(["-c", "print('ok')"], timeout=60).strip() == "ok"
    with pytest.raises(rk.StepFailed, match="boom"):
        rk.run_python(["-c", "import sys; sys.exit('boom')"], timeout=60)


def test_the_versions_probe_reads_package_metadata():
    found = rk.probe_versions()
    assert set(found) == {"jax", "jaxlib", "libtpu"}
    assert (found["jax"], found["jaxlib"]) == (metadata.version("jax"), metadata.version("jaxlib"))


def test_kernel_metadata_describes_a_tpu_script_kernel():
    meta = json.loads((KAGGLE_DIR / "kernel-metadata.json").read_text())
    assert meta["kernel_type"] == "script" and meta["language"] == "python"
    assert meta["enable_tpu"] is True and meta["enable_gpu"] is False and meta["enable_internet"] is True
    assert meta["machine_shape"] == "TpuV5E8"
    assert (KAGGLE_DIR / meta["code_file"]).is_file()
    assert all(isinstance(meta[k], list) for k in ("dataset_sources", "competition_sources", "kernel_sources"))


def _cpu_env() -> dict:
    return {**os.environ, "JAX_PLATFORMS": "cpu"}


def _smoke_on_cpu(edit=lambda code: code) -> str:
    """The smoke test with its TPU-only line dropped and its Pallas call in interpret mode (CPU)."""
    guard = 'assert jax.default_backend() == "tpu"'
    call = "pl.pallas_call(kernel, "
    assert guard in rk.SMOKE_TEST and call in rk.SMOKE_TEST
    lines = [line for line in rk.SMOKE_TEST.splitlines() if not line.startswith(guard)]
    code = "\n".join(lines).replace(call, "pl.pallas_call(kernel, interpret=True, ")
    return rk.run_python(["-c", edit(code)], timeout=300, env=_cpu_env())


def test_the_smoke_test_refuses_a_host_without_a_tpu():
    with pytest.raises(rk.StepFailed, match="backend is cpu, not tpu"):
        rk.run_python(["-c", rk.SMOKE_TEST], timeout=300, env=_cpu_env())


def test_the_smoke_test_runs_a_pallas_kernel_and_checks_its_result():
    report = json.loads(_smoke_on_cpu().strip().splitlines()[-1])
    assert report["devices"] >= 1 and report["device_kind"].lower() == "cpu"
    # A kernel that computes something else is caught by the smoke test's own comparison.
    kernel_line = "o_ref[...] = jnp.exp(x_ref[...]) * 2.0"
    assert kernel_line in rk.SMOKE_TEST
    with pytest.raises(rk.StepFailed, match="wrong Pallas result"):
        _smoke_on_cpu(lambda code: code.replace(kernel_line, "o_ref[...] = jnp.exp(x_ref[...]) * 2.001"))


def test_the_project_dependencies_installed_on_kaggle_are_pyprojects_but_jax():
    """The project installs with --no-deps (the smoke-tested JAX stays), so every other dependency must be
    installed first: a missing one (pyseccomp: the worker's filter; flatbuffers: submitted programs) breaks the
    measure job on the TPU only."""
    import tomllib

    declared = tomllib.loads((KAGGLE_DIR.parent.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    not_jax = [d for d in declared if not d.startswith(("jax>", "jax=", "jaxlib"))]
    assert list(rk.PROJECT_DEPS) == not_jax
