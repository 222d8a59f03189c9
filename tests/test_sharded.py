"""Sharded attention on 8 host devices equals the unsharded kernel, forward and gradient.

The device count must be set (``XLA_FLAGS``) before JAX initialises, so the checks run once in a
fresh interpreter and report JSON; the tests assert on that report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # 8 host devices in a subprocess: about 25 s; the default run stays within 5 minutes

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import functools, json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh
    from kernel_src.flash import FlashBlockSizes, flash_attention
    from kernel_src.attention import pallas_attention
    from kernel_src.reference import reference_attention
    from kernel_src.sharded import attention_mesh, sharded_attention

    report = {"devices": jax.device_count()}
    rng = np.random.default_rng(0)
    batch, q_len, kv_len, hq, hk, d = 4, 72, 96, 4, 2, 32
    q, do = (jnp.asarray(rng.standard_normal((batch, q_len, hq, d), np.float32)) for _ in "ab")
    k, v = (jnp.asarray(rng.standard_normal((batch, kv_len, hk, d), np.float32)) for _ in "ab")
    kv_lengths = jnp.asarray([96, 0, 50, 7], jnp.int32)
    mesh = attention_mesh(batch, hk)
    report["mesh"] = dict(mesh.shape)

    def loss(kernel, sharded, q, k, v):
        if sharded:
            out = sharded_attention(kernel, q, k, v, causal=True, kv_lengths=kv_lengths)
        else:
            out = kernel(q, k, v, causal=True, kv_lengths=kv_lengths)
        return jnp.sum(out.astype(jnp.float32) * do), out

    flash = functools.partial(flash_attention, interpret=True,
                              block_sizes=FlashBlockSizes(*(32,) * 6))
    for name, kernel in (("reference", reference_attention), ("flash", flash),
                         ("pallas", pallas_attention)):
        grad = jax.grad(loss, argnums=(2, 3, 4), has_aux=True)
        (dq0, dk0, dv0), out0 = grad(kernel, False, q, k, v)
        (dq1, dk1, dv1), out1 = grad(kernel, True, q, k, v)
        report[name] = {
            "out_err": float(jnp.max(jnp.abs(out1 - out0))),
            "grad_err": max(float(jnp.max(jnp.abs(a - b)))
                            for a, b in ((dq0, dq1), (dk0, dk1), (dv0, dv1))),
            "out_scale": float(jnp.max(jnp.abs(out0))),
            "grad_scale": float(jnp.max(jnp.abs(dk0))),
            "out_devices": len(out1.sharding.device_set),
        }

    # The default API (no interpret=) under shard_map, exported for TPU from this CPU: Mosaic.
    from jax import export
    def attend(q, k, v):
        return sharded_attention(flash_attention, q, k, v, causal=True, kv_lengths=kv_lengths)
    def grads(q, k, v):
        return jax.grad(lambda *a: jnp.sum(attend(*a) * do), argnums=(0, 1, 2))(q, k, v)
    report["tpu_export_kernels"] = [
        export.export(jax.jit(fn), platforms=["tpu"])(q, k, v).mlir_module().count("tpu_custom_call")
        for fn in (attend, grads)]

    # An explicit 1-D mesh over the kv heads only, without kv_lengths.
    heads_only = Mesh(np.asarray(jax.devices()[:2]), ("heads",))
    out = sharded_attention(reference_attention, q, k, v, mesh=heads_only)
    report["heads_only_err"] = float(jnp.max(jnp.abs(out - reference_attention(q, k, v))))

    errors = {}
    for case, call in {
        "batch_3_on_8": lambda: sharded_attention(reference_attention, q[:3], k[:3], v[:3]),
        "heads_mesh_4": lambda: sharded_attention(
            reference_attention, q, k, v, mesh=Mesh(np.asarray(jax.devices()[:4]), ("heads",))),
        "unknown_axis": lambda: sharded_attention(
            reference_attention, q, k, v, mesh=Mesh(np.asarray(jax.devices()[:2]), ("model",))),
    }.items():
        try:
            call()
            errors[case] = None
        except ValueError as err:
            errors[case] = str(err)
    report["errors"] = errors
    print("REPORT " + json.dumps(report))
""")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    script = tmp_path_factory.mktemp("sharded") / "check_sharded.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(lines[-1][len("REPORT "):])


def test_default_mesh_uses_all_eight_devices(report):
    assert report["devices"] == 8
    assert report["mesh"] == {"batch": 4, "heads": 2}


@pytest.mark.parametrize("kernel,tol", [("reference", 1e-6), ("flash", 2e-5), ("pallas", 2e-5)],
                         ids=["reference", "flash", "pallas"])
def test_sharded_equals_unsharded_forward_and_gradient(report, kernel, tol):
    result = report[kernel]
    assert result["out_devices"] == 8
    assert result["out_scale"] > 0.1 and result["grad_scale"] > 0.1  # not trivially zero
    assert result["out_err"] <= tol
    assert result["grad_err"] <= tol


def test_default_api_exports_mosaic_for_tpu_under_shard_map(report):
    """Forward: one flash kernel; forward + gradients: forward, dQ and dK/dV kernels."""
    assert report["tpu_export_kernels"] == [1, 3]


def test_explicit_heads_only_mesh(report):
    assert report["heads_only_err"] <= 1e-6


def test_meshes_that_cannot_divide_the_problem_raise(report):
    errors = report["errors"]
    assert "cannot split batch=3" in errors["batch_3_on_8"]
    assert "does not divide num_kv_heads=2" in errors["heads_mesh_4"]
    assert "mesh axes must be among" in errors["unknown_axis"]
