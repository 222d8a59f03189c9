"""Synchronized timing of one jitted function: transfer, lowering, compilation and steady state apart.

Every steady-state sample is ``clock()`` before the call and ``clock()`` after ``block_until_ready()``
returned on *every* output leaf, so asynchronous dispatch cannot make a sample look fast. The clock
and the synchronization are injectable for tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax

Clock = Callable[[], float]


def block_until_ready(tree: Any) -> Any:
    """Wait until every leaf of ``tree`` that is an asynchronous result has been computed."""
    for leaf in jax.tree_util.tree_leaves(tree):
        wait = getattr(leaf, "block_until_ready", None)
        if wait is not None:
            wait()
    return tree


@dataclass
class Timing:
    """What timing one case produced; durations in milliseconds, ``None`` where not measured."""

    transfer_ms: float | None = None
    lower_ms: float | None = None
    compile_ms: float | None = None
    samples_ms: list[float] = field(default_factory=list)
    lowered: Any = None
    compiled: Any = None
    output: Any = None


def _ms(seconds: float) -> float:
    return seconds * 1e3


def time_calls(fn: Callable[..., Any], args: Sequence[Any], *, warmups: int, samples: int,
               clock: Clock = time.perf_counter,
               sync: Callable[[Any], Any] = block_until_ready) -> tuple[list[float], Any]:
    """Run ``fn(*args)`` ``warmups`` times untimed, then ``samples`` times timed.

    Returns every sample in ms, in order, and the last output. Each sample stops the clock only
    after ``sync`` returned on the call's output.
    """
    out = None
    for _ in range(warmups):
        out = sync(fn(*args))
    times = []
    for _ in range(samples):
        start = clock()
        out = fn(*args)
        sync(out)
        times.append(_ms(clock() - start))
    return times, out


def time_jitted(fn: Callable[..., Any], abstract_args: Sequence[Any], host_args: Sequence[Any], *,
                warmups: int, samples: int, clock: Clock = time.perf_counter,
                sync: Callable[[Any], Any] = block_until_ready, timing: Timing | None = None) -> Timing:
    """Lower, compile, transfer and time ``jax.jit(fn)``.

    Args:
      fn: the function to measure; its outputs may be any pytree of arrays.
      abstract_args: ``jax.ShapeDtypeStruct`` per argument, used to lower without touching data.
      host_args: numpy arrays per argument; they are placed on the compiled executable's own input
        shardings (one device, or a mesh for sharded functions), which is the timed transfer.
      warmups, samples: untimed and timed steady-state calls.

    The fields of ``timing`` (a new ``Timing`` by default) are filled in as each stage finishes, so
    after a failing stage the caller's ``timing`` still holds the earlier ones.
    """
    timing = Timing() if timing is None else timing
    jitted = jax.jit(fn)
    start = clock()
    timing.lowered = jitted.lower(*abstract_args)
    timing.lower_ms = _ms(clock() - start)
    start = clock()
    timing.compiled = compiled = timing.lowered.compile()
    timing.compile_ms = _ms(clock() - start)
    shardings = compiled.input_shardings[0]
    start = clock()
    device_args = sync([jax.device_put(x, s) for x, s in zip(host_args, shardings)])
    timing.transfer_ms = _ms(clock() - start)
    timing.samples_ms, timing.output = time_calls(compiled, device_args, warmups=warmups,
                                                  samples=samples, clock=clock, sync=sync)
    return timing


def peak_memory_bytes(devices: Sequence[Any]) -> int | None:
    """Sum over ``devices`` of ``memory_stats()["peak_bytes_in_use"]``; ``None`` where not reported.

    The backend reports a high-water mark for the whole process so far, not for one case alone.
    """
    total = 0
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - some backends raise instead of returning None
            stats = None
        if not stats or "peak_bytes_in_use" not in stats:
            return None
        total += int(stats["peak_bytes_in_use"])
    return total
