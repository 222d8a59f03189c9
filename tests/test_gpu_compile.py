"""The Triton kernels compiled for an H100 and an A100 on this CPU (``bench.gpu_compiled``, ``plan --profile h100``).

The parsers, the one-line failure and the committed ``PLAN_H100.md`` are checked in the default run; the
compiles need the CUDA plugin (``pip install -e ".[gpu-plan]"``, run with ``JAX_PLATFORMS=cpu``) and are slow,
skipped with the reason where it is missing.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from tpu_kernel_records_tools.bench import gpu_compiled, plan_gpu
from tpu_kernel_records_tools.cli.main import main

REPO = Path(__file__).resolve().parent.parent
SHARED_MEMORY = ("Shared memory size limit exceeded: requested 1048576, available: 232448, context: []")
THUNKS = """001: kCustomKernel [source       | next=002 (1)] k grid: [1, 1, 1] threads: [128, 1, 1]  shared_memory: 16384 bytes
002: kCustomKernel [prev=001 (1) | sink        ] loop_add_fusion grid: [32, 1, 1] threads: [128, 1, 1]  shared_memory: 0 bytes
"""
PTXAS = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_forward_kernel' for 'sm_90a'
ptxas info    : Function properties for _forward_kernel
    8 bytes stack frame, 260 bytes spill stores, 252 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers
"""


def test_targets_are_sm90_and_sm80_with_their_shared_memory():
    h100, a100 = gpu_compiled.TARGETS["h100"], gpu_compiled.TARGETS["a100"]
    assert (h100.arch, a100.arch) == ("sm_90a", "sm_80")
    assert "shared_memory_per_block_optin: 232448" in h100.config and "major: 9 }" in h100.config
    assert "shared_memory_per_block_optin: 166912" in a100.config and "major: 8 }" in a100.config


def test_thunk_sequence_and_ptxas_are_read():
    assert gpu_compiled.thunk_kernels(THUNKS) == [
        dict(name="k", grid=[1, 1, 1], threads=[128, 1, 1], shared_memory_bytes=16384),
        dict(name="loop_add_fusion", grid=[32, 1, 1], threads=[128, 1, 1], shared_memory_bytes=0)]
    assert gpu_compiled.ptxas_facts(PTXAS) == {"_forward_kernel": dict(
        registers=255, stack_bytes=8, spill_store_bytes=260, spill_load_bytes=252)}


def test_triton_kernels_are_told_from_xla_fusions_by_their_custom_call():
    hlo = ('  %pallas_call.1 = f32[64,64]{1,0} custom-call(%a.1), custom_call_target="__gpu$xla.gpu.triton", '
           'backend_config={debug = false, grid_x = 1 : i32, ir = "ML", name = "_dkv_kernel", num_stages = 3 : i32}\n'
           '  %fusion = f32[64,64]{1,0} fusion(%pallas_call.1), kind=kLoop, calls=%fused_add, '
           'backend_config={"name":"loop_add_fusion"}\n')
    assert gpu_compiled.triton_names(hlo) == {"_dkv_kernel"}


def test_a_failure_is_one_line_naming_kernel_shape_target_and_message():
    error = RuntimeError(f"RESOURCE_EXHAUSTED: {SHARED_MEMORY}\n\nstack trace follows")
    line = gpu_compiled.failure_line("flash fwd", "b1 s256", "h100", error)
    assert line == f"flash fwd at b1 s256 does not compile for h100 (sm_90a): RESOURCE_EXHAUSTED: {SHARED_MEMORY}"


def test_plan_command_ends_in_one_line_when_a_kernel_does_not_compile(monkeypatch, capsys):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setattr(gpu_compiled, "unavailable_reason", lambda: None)

    def refuse(targets, progress):
        assert targets == ("h100", "a100")
        raise gpu_compiled.CompileFailure("flash fwd at b1 s256 does not compile for h100 (sm_90a): too big")
    monkeypatch.setattr(plan_gpu, "plan_rows", refuse)
    assert main(["plan", "--profile", "h100"]) == 1
    err = capsys.readouterr().err
    assert err == "plan: flash fwd at b1 s256 does not compile for h100 (sm_90a): too big\n"


def test_plan_command_without_the_plugin_says_how_to_get_it(monkeypatch, capsys):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setattr(gpu_compiled, "plugin_version", lambda: None)
    assert main(["plan", "--profile", "h100"]) == 1
    assert capsys.readouterr().err == (
        'plan: cannot compile for a GPU here: no JAX CUDA plugin: `pip install -e ".[gpu-plan]"` to compile '
        "for a GPU without one\n")


def test_committed_plan_has_every_program_for_both_targets_labelled_as_prediction():
    text = (REPO / "PLAN_H100.md").read_text()
    assert plan_gpu.LABEL in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| h100 ") or line.startswith("| a100 ")]
    compiled = sorted((r[0].strip("| "), r[1], r[2], r[3].strip("`")) for r in rows)
    wanted = sorted((t, p.kernel, p.shape, k) for t in ("h100", "a100") for p in plan_gpu.programs() for k in p.triton)
    assert compiled == wanted


_REASON = gpu_compiled.unavailable_reason()
needs_plugin = pytest.mark.skipif(_REASON is not None, reason=str(_REASON))


def _flash_forward(seq=256, head_dim=64, blocks=None):
    from kernel_src.flash import flash_attention

    q = jax.ShapeDtypeStruct((1, seq, 4, head_dim), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, seq, 2, head_dim), jnp.bfloat16)
    attend = lambda q, k, v: flash_attention(q, k, v, causal=True, block_sizes=blocks)  # noqa: E731
    return plan_gpu.Program("flash fwd", f"b1 s{seq} h4/2 d{head_dim} bf16", attend, (q, kv, kv))


@pytest.mark.slow
@needs_plugin
@pytest.mark.parametrize("target", ["h100", "a100"])
def test_flash_forward_compiles_with_its_compiler_facts(target):
    [row] = plan_gpu.plan_rows((target,), [_flash_forward()])
    [kernel] = [k for k in row["kernels"] if k["triton"]]
    assert kernel["name"] == "_forward_kernel"
    assert row["arch"] == gpu_compiled.TARGETS[target].arch
    assert 0 < kernel["shared_memory_bytes"] <= {"h100": 232448, "a100": 166912}[target]
    assert 0 < kernel["registers"] <= 255 and kernel["threads"] == [128, 1, 1]
    assert kernel["grid"] == [1, 4, 2]  # batch, q heads, query blocks of the GPU default (128 rows)


@pytest.mark.slow
@needs_plugin
def test_a_kernel_needing_more_shared_memory_than_an_h100_fails_in_one_line():
    from kernel_src.flash import FlashBlockSizes

    huge = _flash_forward(seq=1024, head_dim=256, blocks=FlashBlockSizes(*(512,) * 6))
    with pytest.raises(gpu_compiled.CompileFailure) as failure:
        plan_gpu.plan_rows(("h100",), [huge])
    line = str(failure.value)
    assert "\n" not in line and line.startswith("flash fwd at b1 s1024 h4/2 d256 bf16 does not compile for h100")
    assert "Shared memory size limit exceeded" in line and "available: 232448" in line
