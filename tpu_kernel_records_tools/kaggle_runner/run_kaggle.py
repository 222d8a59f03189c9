"""Kaggle TPU v5e-8 runner: bootstrap a JAX that runs Pallas on this image, then measure.

Pushed as a Kaggle script kernel (``kernel-metadata.json`` beside this file). It runs standalone,
before this project is installed, so it imports nothing from it. Steps:

1. Try each JAX in ``ATTEMPTS`` in order: the newest ``jax``/``jaxlib`` against the image's own
   libtpu first, then ``jax[tpu]==0.6.2`` with its matching libtpu. After each install a fresh
   interpreter runs a tiny Pallas kernel on the TPU (the smoke test); the first JAX that passes is
   used. Every attempt is recorded (versions, outcome ``used``/``rejected``/``failed``, error text)
   in ``bootstrap.json``, which the measure job copies into the environment record's ``bootstrap``.
2. Install this project (``--no-deps``, so the JAX just chosen stays) from ``PROJECT_SPEC``,
   ``$TPU_KERNEL_RECORDS_PROJECT``, or a wheel / sdist found under ``/kaggle/input``.
3. Run ``python -m tpu_kernel_records_tools measure --profile tpu-v5e`` in ``/kaggle/working``; the run folder is left
   in ``/kaggle/working/runs/<run_id>/`` for ``kaggle kernels output``.

Every step with side effects (pip, the smoke test, the measure job) is a function passed to
``main``, so the logic is tested on a CPU without Kaggle, pip or a TPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

PROJECT_SPEC: str | None = None  # e.g. "git+https://github.com/<you>/tpu-kernel-records@<commit>"
PROJECT_ENV = "TPU_KERNEL_RECORDS_PROJECT"
BOOTSTRAP_ENV = "TPU_KERNEL_RECORDS_BOOTSTRAP"
LIBTPU_RELEASES = "https://storage.googleapis.com/jax-releases/libtpu_releases.html"
# pyproject.toml's dependencies but JAX's (the project installs with --no-deps, so the JAX the smoke test chose
# stays); tests/test_kaggle_runner.py holds the two lists equal
PROJECT_DEPS = ("numpy>=1.26", "pyarrow>=15", "datasets>=3.0", "huggingface_hub>=0.24", "tqdm>=4.66", "jsonschema>=4.18",
                "matplotlib>=3.8", "psutil>=5.9", "filelock>=3.12", "PyYAML>=6", "dask[distributed]>=2024.1",
                "flatbuffers>=24", "pyseccomp>=0.1.2; sys_platform == 'linux'")
MAX_ERROR_CHARS = 4000


@dataclass(frozen=True)
class Attempt:
    """One JAX to try: a label and the ``pip install`` arguments that bring it."""

    label: str
    pip_args: tuple[str, ...]


ATTEMPTS = (
    Attempt("newest jax with the image's libtpu", ("--upgrade", "jax", "jaxlib")),
    Attempt("jax[tpu]==0.6.2", ("jax[tpu]==0.6.2", "-f", LIBTPU_RELEASES)),
)

SMOKE_TEST = r"""
import json, jax, jax.numpy as jnp
from jax.experimental import pallas as pl
assert jax.default_backend() == "tpu", f"backend is {jax.default_backend()}, not tpu"
def kernel(x_ref, o_ref):
    o_ref[...] = jnp.exp(x_ref[...]) * 2.0
x = jnp.linspace(-1.0, 1.0, 8 * 128, dtype=jnp.float32).reshape(8, 128)
y = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
assert bool(jnp.allclose(y, jnp.exp(x) * 2.0, rtol=1e-5)), "wrong Pallas result"
print(json.dumps({"devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind}))
"""

VERSIONS_PROBE = r"""
import json, importlib.metadata as md
def v(*names):
    for n in names:
        try:
            return md.version(n)
        except md.PackageNotFoundError:
            pass
print(json.dumps({"jax": v("jax"), "jaxlib": v("jaxlib"), "libtpu": v("libtpu", "libtpu-nightly")}))
"""


class StepFailed(RuntimeError):
    """A subprocess step failed; the message carries the tail of its output."""


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= MAX_ERROR_CHARS else "..." + text[-MAX_ERROR_CHARS:]


def run_python(code_or_args: Sequence[str], *, timeout: float, env: dict | None = None,
               cwd: Path | None = None) -> str:
    """Run ``python <args>`` in a fresh interpreter; return stdout or raise ``StepFailed``."""
    try:
        done = subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise StepFailed(f"timed out after {timeout:.0f} s: python {' '.join(code_or_args)[:200]}") from None
    if done.returncode != 0:
        raise StepFailed(_tail(done.stderr or done.stdout) or f"exit status {done.returncode}")
    return done.stdout


def pip_install(args: Sequence[str]) -> None:
    """``python -m pip install <args>`` (quiet); raises ``StepFailed`` with pip's error."""
    run_python(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args], timeout=1800)


def probe_versions() -> dict[str, str | None]:
    """jax, jaxlib and libtpu versions as now installed, read from package metadata in a fresh process."""
    return json.loads(run_python(["-c", VERSIONS_PROBE], timeout=120).strip().splitlines()[-1])


def smoke_test() -> None:
    """Run the Pallas smoke kernel on the TPU in a fresh process; raises ``StepFailed`` if it fails."""
    print(run_python(["-c", SMOKE_TEST], timeout=900).strip(), flush=True)


def bootstrap(attempts: Sequence[Attempt], *, install: Callable[[Sequence[str]], None],
              probe: Callable[[], dict], smoke: Callable[[], None],
              log: Callable[[str], None] = print) -> list[dict]:
    """Try each attempt until one passes the smoke test; return every attempt's record, in order.

    Records follow environment.schema.json's ``bootstrap`` items: ``jax``, ``jaxlib``, ``libtpu``,
    ``outcome`` (``used`` for the one kept, ``rejected`` when the smoke test failed, ``failed``
    when the install failed) and ``error``. At most the last record is ``used``.
    """
    records = []
    for attempt in attempts:
        log(f"bootstrap: trying {attempt.label}")
        try:
            install(attempt.pip_args)
        except Exception as error:  # noqa: BLE001 - recorded, then the next attempt
            versions = _safe_probe(probe)
            records.append({**versions, "jax": versions["jax"] or attempt.label, "outcome": "failed",
                            "error": _tail(f"install failed ({attempt.label}): {error}")})
            continue
        versions = _safe_probe(probe)
        record = {**versions, "jax": versions["jax"] or "unknown"}
        try:
            smoke()
        except Exception as error:  # noqa: BLE001
            records.append({**record, "outcome": "rejected",
                            "error": _tail(f"Pallas smoke test failed ({attempt.label}): {error}")})
            continue
        records.append({**record, "outcome": "used", "error": None})
        log(f"bootstrap: using jax {record['jax']}, jaxlib {record['jaxlib']}, libtpu {record['libtpu']}")
        break
    return records


def _safe_probe(probe: Callable[[], dict]) -> dict:
    try:
        found = probe()
    except Exception:  # noqa: BLE001 - versions unknown is still worth recording
        found = {}
    return {key: found.get(key) for key in ("jax", "jaxlib", "libtpu")}


def find_project(input_dir: Path = Path("/kaggle/input"), environ: dict | None = None) -> str:
    """The pip spec of this project: ``PROJECT_SPEC``, ``$TPU_KERNEL_RECORDS_PROJECT``, or the newest
    ``tpu_kernel_records-*.whl`` / ``tpu_kernel_records-*.tar.gz`` under ``input_dir``."""
    environ = os.environ if environ is None else environ
    spec = PROJECT_SPEC or environ.get(PROJECT_ENV)
    if spec:
        return spec
    found = sorted(input_dir.rglob("tpu_kernel_records-*.whl")) or sorted(input_dir.rglob("tpu_kernel_records-*.tar.gz"))
    if not found:
        raise StepFailed(f"project not found: set PROJECT_SPEC in {Path(__file__).name}, ${PROJECT_ENV}, "
                         f"or attach a dataset holding a tpu_kernel_records wheel under {input_dir}")
    return str(found[-1])


def run_measure_job(workdir: Path, bootstrap_file: Path) -> int:
    """``python -m tpu_kernel_records_tools measure --profile tpu-v5e`` in ``workdir``, output to the log."""
    env = {**os.environ, BOOTSTRAP_ENV: str(bootstrap_file)}
    return subprocess.run([sys.executable, "-m", "tpu_kernel_records_tools", "measure", "--profile", "tpu-v5e"],
                          cwd=workdir, env=env).returncode


def main(argv: Sequence[str] | None = None, *, workdir: Path = Path("/kaggle/working"),
         attempts: Sequence[Attempt] = ATTEMPTS,
         install: Callable[[Sequence[str]], None] = pip_install,
         probe: Callable[[], dict] = probe_versions, smoke: Callable[[], None] = smoke_test,
         locate: Callable[[], str] = find_project,
         measure: Callable[[Path, Path], int] = run_measure_job,
         log: Callable[[str], None] = print) -> int:
    """Bootstrap, install, measure. Returns the exit status: 0 when a run folder was written."""
    workdir.mkdir(parents=True, exist_ok=True)
    bootstrap_file = workdir / "bootstrap.json"
    try:
        project = locate()
    except StepFailed as error:
        log(f"error: {error}")
        return 2
    records = bootstrap(attempts, install=install, probe=probe, smoke=smoke, log=log)
    bootstrap_file.write_text(json.dumps(records, indent=2) + "\n")
    if not records or records[-1]["outcome"] != "used":
        log(f"error: no JAX passed the Pallas smoke test; attempts are in {bootstrap_file}")
        return 1
    try:
        install([*PROJECT_DEPS])
        install(["--no-deps", project])
    except Exception as error:  # noqa: BLE001
        log(f"error: installing the project ({project}) failed: {error}")
        return 1
    status = measure(workdir, bootstrap_file)
    log(f"measure exited with status {status}; run folders under {workdir / 'runs'}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
