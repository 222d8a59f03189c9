"""Programs compiled for an NVIDIA H100 or A100 on a machine without a GPU, and what the compilers say.

With the CUDA plugin installed (``pip install -e ".[gpu-plan]"``: ``jax-cuda12-plugin`` without the CUDA
libraries, and ``ptxas`` from ``nvidia-cuda-nvcc-cu12``) and JAX's platforms limited to the CPU
(``JAX_PLATFORMS=cpu``, so the plugin does not look for a driver),
``jax.experimental.topologies.get_topology_desc(platform="cuda", target_config=..., topology="1x1x1")``
describes one GPU from its ``GpuTargetConfig`` text (``TARGETS``), and ``jax.jit(f).lower(...).compile()``
on its device runs XLA's GPU compiler: Pallas' Triton kernels are compiled to PTX and by ``ptxas`` to
SASS. A block that needs more shared memory than the GPU has is refused here. Nothing runs.

What is read back per kernel (``compile_facts``): grid, threads per block and shared memory per block
from XLA's thunk sequence, registers per thread and spills from ``ptxas -v`` on the PTX XLA wrote, and
the program's ``memory_analysis()`` (XLA's GPU ``cost_analysis()`` of a compiled program is ``None`` in
jax 0.10: recorded as such). Every figure is the compiler's prediction, never a measurement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import jax


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """One GPU to compile for: its ``ptxas`` architecture and XLA's ``GpuTargetConfig`` text proto."""

    name: str
    arch: str
    config: str


def _config(device: str, major: int, cores: int, fpus: int, smem_core: int, smem_optin: int,
            bandwidth: int, l2: int, clock: float, memory: int) -> str:
    """A ``GpuTargetConfig`` text proto; the figures are the device's specifications (XLA's specs/)."""
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: {smem_core} threads_per_core_limit: 2048 core_count: {cores}
  fpus_per_core: {fpus} block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: {bandwidth} l2_cache_size: {l2}
  clock_rate_ghz: {clock} device_memory_size: {memory} shared_memory_per_block_optin: {smem_optin}
  cuda_compute_capability {{ major: {major} }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 }}
device_description_str: "{device}"
"""


#: The GPUs the plan compiles for: H100 SXM (sm_90, 227 KiB shared memory per block) and A100 SXM
#: 80 GB (sm_80, 163 KiB).
TARGETS: dict[str, GpuTarget] = {
    "h100": GpuTarget("h100", "sm_90a", _config("NVIDIA H100 80GB HBM3", 9, 132, 128, 233472, 232448,
                                                3352320000000, 52428800, 1.98, 84942979072)),
    "a100": GpuTarget("a100", "sm_80", _config("NVIDIA A100-SXM4-80GB", 8, 108, 64, 167936, 166912,
                                               2039040000000, 41943040, 1.41, 85100068864)),
}
PLUGINS = ("jax-cuda12-plugin", "jax-cuda13-plugin")


class CompileFailure(RuntimeError):
    """A kernel that the GPU compiler refused; ``str()`` is one line naming kernel, shape and target."""


def failure_line(kernel: str, shape: str, target: str, error: BaseException) -> str:
    """One line: ``kernel at shape does not compile for target: <the compiler's first line>``."""
    message = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
    return f"{kernel} at {shape} does not compile for {target} ({TARGETS[target].arch}): {message}"[:400]


def plugin_version() -> str | None:
    """``name==version`` of the installed JAX CUDA plugin, ``None`` if none."""
    for dist in PLUGINS:
        try:
            return f"{dist}=={importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def ptxas() -> str | None:
    """Path of the ``ptxas`` the plugin compiles with (``nvidia-cuda-nvcc-*`` wheel, else PATH)."""
    try:
        import nvidia.cuda_nvcc as nvcc  # type: ignore[import-not-found]
        found = [Path(p) / "bin" / "ptxas" for p in nvcc.__path__]
        return next((str(p) for p in found if p.exists()), None) or shutil.which("ptxas")
    except ImportError:
        return shutil.which("ptxas")


def unavailable_reason() -> str | None:
    """Why GPU programs cannot be compiled here (one line), or ``None`` when they can."""
    plugin = plugin_version()
    if plugin is None:
        return 'no JAX CUDA plugin: `pip install -e ".[gpu-plan]"` to compile for a GPU without one'
    if plugin.split("==")[1] != jax.__version__:
        return f"{plugin} is installed but jax is {jax.__version__}: install the matching plugin"
    if ptxas() is None:
        return "no ptxas: `pip install nvidia-cuda-nvcc-cu12` (the gpu-plan extra has it)"
    try:
        devices("h100")
    except Exception as error:  # noqa: BLE001 - reported, not hidden
        return (f"no CUDA topology ({type(error).__name__}: {str(error).splitlines()[0][:200]}); run with "
                "JAX_PLATFORMS=cpu so that the plugin loads without a driver")
    return None


@functools.cache
def devices(target: str) -> tuple[Any, ...]:
    """The one device of ``target``'s ``1x1x1`` topology (``"h100"`` or ``"a100"``)."""
    from jax.experimental import topologies

    desc = topologies.get_topology_desc(platform="cuda", target_config=TARGETS[target].config,
                                        topology="1x1x1")
    return tuple(desc.devices)


def on_gpu(abstract_args: Sequence[Any], target: str) -> tuple[jax.ShapeDtypeStruct, ...]:
    """``abstract_args`` (anything with shape and dtype; ``None`` kept) placed on ``target``'s device."""
    sharding = jax.sharding.SingleDeviceSharding(devices(target)[0])
    return tuple(None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
                 for a in abstract_args)


_THUNK = re.compile(r"kCustomKernel \[[^\]]*\] (\S+) grid: \[([\d, ]+)\] threads: \[([\d, ]+)\]\s+"
                    r"shared_memory: (\d+) bytes")
_ENTRY = re.compile(r"Function properties for (\S+)\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                    r"(\d+) bytes spill loads\n.*?Used (\d+) registers", re.S)


def thunk_kernels(thunk_text: str) -> list[dict[str, Any]]:
    """Each kernel launch of XLA's thunk sequence: name, grid, threads and shared memory per block."""
    return [dict(name=name, grid=[int(n) for n in grid.split(",")], threads=[int(n) for n in threads.split(",")],
                 shared_memory_bytes=int(smem))
            for name, grid, threads, smem in _THUNK.findall(thunk_text)]


def triton_names(hlo_text: str) -> set[str]:
    """The names of the Triton kernels (Pallas calls) of a compiled program's HLO."""
    return set(re.findall(r'custom_call_target="__gpu\$xla\.gpu\.triton".*?\bname = "([^"]+)"', hlo_text))


def ptxas_facts(ptxas_text: str) -> dict[str, dict[str, int]]:
    """Per entry function of ``ptxas -v`` output: registers per thread, stack frame and spill bytes."""
    return {name: dict(registers=int(regs), stack_bytes=int(stack), spill_store_bytes=int(stores),
                       spill_load_bytes=int(loads))
            for name, stack, stores, loads, regs in _ENTRY.findall(ptxas_text)}


def _assemble(dump: Path, arch: str) -> dict[str, dict[str, int]]:
    facts = {}
    for ptx in sorted(dump.glob("*.ptx")):
        if ".version" not in ptx.read_text()[:4096]:  # an empty module
            continue
        run = subprocess.run([ptxas(), f"-arch={arch}", "-v", str(ptx), "-o", os.devnull],
                             capture_output=True, text=True, check=True)
        facts.update(ptxas_facts(run.stdout + run.stderr))
    return facts


def compile_facts(fn: Callable[..., Any], abstract_args: Sequence[Any], target: str, *, kernel: str,
                  shape: str) -> dict[str, Any]:
    """``fn`` compiled for ``target`` at ``abstract_args``' shapes and what the compilers said, JSON-able.

    ``kernels``: each launch (XLA's fusions too; ``triton`` marks the Pallas kernels) with grid, threads,
    shared memory per block (bytes) and, from ``ptxas -v``, registers per thread and spill bytes. Raises ``CompileFailure`` (one line
    naming ``kernel``, ``shape`` and the compiler's message) when it does not compile.
    """
    args = on_gpu(abstract_args, target)
    with tempfile.TemporaryDirectory(prefix="gpu-plan-") as tmp:
        try:
            with _no_cache():  # a cached executable would leave no dump to read
                compiled = jax.jit(fn).lower(*args).compile(compiler_options={"xla_dump_to": tmp})
        except Exception as error:  # noqa: BLE001 - re-raised as one line
            raise CompileFailure(failure_line(kernel, shape, target, error)) from error
        dump = Path(tmp)
        thunks = "".join(p.read_text() for p in dump.glob("*thunk_sequence.txt"))
        registers = _assemble(dump, TARGETS[target].arch)
    memory = compiled.memory_analysis()
    triton = triton_names(compiled.as_text())
    launches = [{**k, "triton": k["name"] in triton, **registers.get(k["name"], {})} for k in thunk_kernels(thunks)]
    return dict(kernel=kernel, shape=shape, target=target, arch=TARGETS[target].arch,
                device_kind=str(devices(target)[0].device_kind), cost_analysis=compiled.cost_analysis(),
                argument_bytes=int(memory.argument_size_in_bytes), output_bytes=int(memory.output_size_in_bytes),
                temp_bytes=int(memory.temp_size_in_bytes), kernels=launches)


@contextlib.contextmanager
def _no_cache():
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
