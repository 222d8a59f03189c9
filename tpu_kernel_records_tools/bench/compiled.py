"""Programs compiled for a TPU v5e on any host, and what the TPU compiler says about them.

The ``libtpu`` wheel that the installed JAX pins (``jax[tpu]``: libtpu 0.0.42.* for jax 0.10.2,
0.0.17.* for jax 0.6.2) holds the whole TPU compiler, Mosaic included. With it,
``jax.experimental.topologies.get_topology_desc("v5e:1x1", "tpu")`` describes v5e chips that
``jax.jit(f).lower(...).compile()`` accepts on a machine without one. Nothing runs: a compiled
program reports its optimized HLO, XLA's ``cost_analysis()`` (FLOPs and bytes accessed; a Pallas
kernel contributes only what its ``pl.CostEstimate`` declares) and ``memory_analysis()``
(argument, output and temporary HBM bytes). Every figure here is the compiler's plan, never a
measurement.

JAX's default backend stays whatever it was (CPU here): only arrays placed on the topology's
devices (``struct``) are compiled for TPU.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
from typing import Any, Callable, Sequence

import jax

# libtpu asks the (absent) GCE metadata server who it is unless told; these make it quiet and
# let several processes (parallel test runs) load it at once.
_LIBTPU_ENV = dict(TPU_SKIP_MDS_QUERY="1", TPU_ACCELERATOR_TYPE="v5litepod-1",
                   TPU_WORKER_HOSTNAMES="localhost", TPU_WORKER_ID="0",
                   ALLOW_MULTIPLE_LIBTPU_LOAD="1")


def libtpu_pin() -> str | None:
    """The libtpu requirement of the installed JAX's ``tpu`` extra, e.g. ``libtpu==0.0.42.*``."""
    for requirement in importlib.metadata.requires("jax") or ():
        name = re.match(r"\s*(libtpu(?:-nightly)?)\s*([^;]*)", requirement)
        if name and 'extra == "tpu"' in requirement:
            return (name.group(1) + name.group(2)).replace(" ", "")
    return None


def libtpu_version() -> str | None:
    """Version of the installed libtpu (or libtpu-nightly) distribution, ``None`` if absent."""
    for dist in ("libtpu", "libtpu-nightly"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def unavailable_reason() -> str | None:
    """Why v5e programs cannot be compiled here (one line), or ``None`` when they can."""
    pin, version = libtpu_pin(), libtpu_version()
    if version is None:
        return (f"libtpu is not installed: `pip install '{pin}'` (the wheel jax "
                f"{jax.__version__}'s tpu extra pins) to compile for TPU without a TPU")
    if pin and "==" in pin:
        wanted = pin.split("==", 1)[1].rstrip("*").rstrip(".")
        if not version.startswith(wanted):
            return f"libtpu {version} is installed but jax {jax.__version__} pins {pin}"
    try:
        v5e_devices()
    except Exception as error:  # noqa: BLE001 - reported, not hidden
        return f"no v5e topology from libtpu {version}: {type(error).__name__}: {error}"[:300]
    return None


@functools.cache
def v5e_devices(topology: str = "v5e:1x1") -> tuple[Any, ...]:
    """The devices of a v5e topology (``"v5e:1x1"``, ``"v5e:2x2"``, ``"v5e:2x4"``), one host."""
    from jax.experimental import topologies

    for key, value in _LIBTPU_ENV.items():
        os.environ.setdefault(key, value)
    x, y = (int(n) for n in topology.split(":", 1)[1].split("x"))
    desc = topologies.get_topology_desc(topology_name=topology, platform="tpu",
                                        chips_per_host_bounds=(x, y, 1))
    return tuple(desc.devices)


def struct(shape: Sequence[int], dtype: Any, sharding: Any = None) -> jax.ShapeDtypeStruct:
    """An abstract array on one v5e chip (or with ``sharding`` over topology devices)."""
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(v5e_devices()[0])
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def on_v5e(abstract_args: Sequence[jax.ShapeDtypeStruct]) -> tuple[jax.ShapeDtypeStruct, ...]:
    """``abstract_args`` (shapes and dtypes of any placement) placed on one v5e chip."""
    return tuple(struct(a.shape, a.dtype) for a in abstract_args)


def compile_program(fn: Callable[..., Any], abstract_args: Sequence[jax.ShapeDtypeStruct]):
    """``jax.jit(fn)`` lowered and compiled for the devices ``abstract_args`` sit on."""
    return jax.jit(fn).lower(*abstract_args).compile()


# --- reading the compiled program --------------------------------------------------------------

_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
               "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b([a-z]+[0-9]+|pred)\[([0-9,]*)\](\{[^}]*\})?")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = (.*)$")
# Ops that move no data, or whose move is counted at their partner (``*-start`` at ``*-done``).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "iota",
         "partition-id", "replica-id", "opt-barrier"}


def _array_bytes(shape_text: str) -> int:
    """Logical bytes (shape x dtype) of every array in an HLO shape, tuples included."""
    total = 0
    for dtype, dims, _ in _ARRAY.findall(shape_text):
        count = 1
        for dim in filter(None, dims.split(",")):
            count *= int(dim)
        total += count * _ITEM_BYTES.get(dtype, 0)
    return total


def _split_instruction(rest: str) -> tuple[str, str, list[str], str]:
    """``(shape, opcode, operand names, attributes)`` of the text after ``name = ``."""
    if rest.startswith("("):  # tuple shape: up to its balanced closing parenthesis
        depth = 0
        for end, char in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
        shape, rest = rest[:end + 1], rest[end + 2:]
    else:
        shape, _, rest = rest.partition(" ")
    opcode, _, rest = rest.partition("(")
    depth, end = 1, len(rest)
    for end, char in enumerate(rest):  # operands may print their layouts, e.g. {1,0:T(8,128)}
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            break
    return shape, opcode, re.findall(r"%([\w.\-]+)", rest[:end]), rest[end + 1:]


def entry_ops(hlo_text: str) -> list[dict[str, Any]]:
    """The ENTRY computation's instructions: name, opcode, shape, operand shapes, attributes."""
    shapes, ops, in_entry = {}, [], False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            in_entry = True
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            in_entry = in_entry and line.strip() != "}"
            continue
        shape, opcode, operands, attrs = _split_instruction(match.group(2))
        shapes[match.group(1)] = shape
        if in_entry:
            ops.append(dict(name=match.group(1), opcode=opcode, shape=shape, attrs=attrs,
                            operand_shapes=[shapes.get(o, "") for o in operands]))
    return ops


def _is_kernel(op: dict[str, Any]) -> bool:
    return op["opcode"] == "custom-call" and 'custom_call_target="tpu_custom_call"' in op["attrs"]


def _is_operand_prefetch(op: dict[str, Any]) -> bool:
    """XLA's HBM -> VMEM copy of a kernel operand (``S(1)``): it replaces the kernel's own read."""
    if op["opcode"] == "custom-call":
        return 'custom_call_target="ConcatBitcast"' in op["attrs"]
    return op["opcode"] in ("copy-done", "slice-done") and "S(1)" in op["shape"]


def outside_ops(hlo_text: str) -> list[dict[str, Any]]:
    """Data-moving entry ops other than the Pallas kernels, with their bytes read + written.

    Operand prefetches into VMEM are left out (the kernel would read those bytes anyway); an
    async ``*-done`` counts its result twice (read the source, write the copy).
    """
    moved = []
    for op in entry_ops(hlo_text):
        if (_is_kernel(op) or op["opcode"] in _FREE or op["opcode"].endswith("-start")
                or _is_operand_prefetch(op)):
            continue
        if op["opcode"].endswith("-done"):
            nbytes = 2 * _array_bytes(op["shape"])
        else:
            nbytes = _array_bytes(op["shape"]) + sum(map(_array_bytes, op["operand_shapes"]))
        moved.append(dict(name=op["name"], opcode=op["opcode"], bytes=nbytes))
    return moved


def kernels(hlo_text: str) -> list[dict[str, Any]]:
    """Each Pallas TPU kernel: its name, the VMEM it reserves, its result bytes, and the FLOPs
    and bytes its ``pl.CostEstimate`` declares (``None`` when it declares none)."""
    found = []
    for op in entry_ops(hlo_text):
        if _is_kernel(op):
            vmem = re.findall(r'"used_scoped_memory_configs":\[[^\]]*?"size":"(\d+)"', op["attrs"])
            declared = re.search(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"(\d+)",'
                                 r'"bytes_accessed":"(\d+)"', op["attrs"])
            found.append(dict(name=op["name"], vmem_bytes=max(map(int, vmem), default=None),
                              result_bytes=_array_bytes(op["shape"]),
                              declared_flops=int(declared.group(1)) if declared else None,
                              declared_bytes=int(declared.group(3)) if declared else None))
    return found


def analyse(compiled) -> dict[str, Any]:
    """The compiler's plan of one program, JSON-able: cost, memory, kernels, bytes outside them.

    ``flops`` / ``bytes_accessed``: XLA's cost analysis (kernels count what they declare);
    ``argument_bytes`` etc.: memory analysis; ``outside_bytes``: read + write bytes of the ops
    around the kernels (``outside_ops``); ``vmem_bytes``: the most VMEM any one kernel reserves.
    """
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # jax 0.6 returns one dict per program
        cost = cost[0] if cost else {}
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    found, moved = kernels(text), outside_ops(text)
    return dict(
        flops=float(cost.get("flops", -1.0)), bytes_accessed=float(cost.get("bytes accessed", -1.0)),
        argument_bytes=int(memory.argument_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        temp_bytes=int(memory.temp_size_in_bytes),
        generated_code_bytes=int(memory.generated_code_size_in_bytes),
        kernels=found, vmem_bytes=max((k["vmem_bytes"] or 0 for k in found), default=0),
        outside_bytes=sum(o["bytes"] for o in moved),
        outside_ops=sorted({o["opcode"] for o in moved}))


def compiled_facts(fn: Callable[..., Any], abstract_args: Sequence[jax.ShapeDtypeStruct]
                   ) -> dict[str, Any]:
    """``analyse`` of ``fn`` compiled for one v5e chip at ``abstract_args``' shapes, labelled.

    For ``measure``: works on any host with the pinned libtpu; raises when it cannot compile.
    """
    facts = analyse(compile_program(fn, on_v5e(abstract_args)))
    return dict(source="compiled for TPU v5e by libtpu without a chip: the compiler's plan, "
                       "not a measurement", device_kind=str(v5e_devices()[0].device_kind),
                jax=jax.__version__, libtpu=libtpu_version(), **facts)
