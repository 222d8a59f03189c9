"""Timing a submitted kernel's program: fresh inputs per call, each call synchronized on its own.

``time_program`` compiles the program once, then for each sample makes that sample's inputs
(``make_inputs(i)``, fresh values every time) and moves them to the device outside the timed region,
times the one call from dispatch to ``block_until_ready`` on every output leaf, and keeps every sample.
Each output's sha256 is taken after its clock stopped. Only then the run's check entropy (drawn by the
measuring process after the export finished, recorded in the run) picks the calls whose outputs are
checked (``output_checks``): each picked call is run again on its regenerated inputs, its
output must be the same bits as the timed one, and ``check`` judges it against the truth. A program
cannot know in advance which call will be checked, nor return in one call work done for another
(its inputs did not exist yet), nor leave its work to the checker (the clock waits for every output).

``roofline_floor_ms``: the least time the shape's useful FLOPs and bytes allow on the device's peak
(``bench.roofline``); ``None`` for a device the table does not know (a CPU).
"""

from __future__ import annotations

import hashlib
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import jax
import numpy as np

from ..bench import roofline
from ..bench.timing import Clock, block_until_ready

DEFAULT_CHECKED = 3  # timed calls whose outputs are checked, per case


@dataclass
class ProgramTiming:
    samples_ms: list[float] = field(default_factory=list)
    lower_ms: float | None = None
    compile_ms: float | None = None
    transfer_ms: float | None = None  # the first sample's inputs to the device (every sample's is untimed)
    output_checks: list[dict[str, Any]] = field(default_factory=list)


def output_digest(output: Any) -> str:
    digest = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(output):
        digest.update(np.ascontiguousarray(np.asarray(jax.device_get(leaf))).reshape(-1).view(np.uint8))
    return digest.hexdigest()


def checked_samples(samples: int, entropy: str, key: str, count: int = DEFAULT_CHECKED) -> list[int]:
    """The timed calls whose outputs are checked, from the run's check entropy (hex) and the case ``key``."""
    rng = np.random.default_rng([int(entropy, 16), zlib.crc32(key.encode())])
    return sorted(int(i) for i in rng.choice(samples, size=min(count, samples), replace=False))


def time_program(fn: Callable[..., Any], abstract_args: Sequence[Any],
                 make_inputs: Callable[[int], list[np.ndarray]], *, warmups: int, samples: int,
                 check: Callable[[int, list[np.ndarray], Any], tuple[bool, str]], entropy: str, key: str,
                 checked: int = DEFAULT_CHECKED, clock: Clock = time.perf_counter,
                 sync: Callable[[Any], Any] = block_until_ready,
                 preflight: Callable[[Any], None] | None = None) -> ProgramTiming:
    """Time ``jax.jit(fn)`` (see module doc). ``check(i, host inputs, output) -> (passed, detail)``;
    ``preflight(compiled)`` runs once it is compiled, before any call (it raises to stop one)."""
    timing = ProgramTiming()
    start = clock()
    lowered = jax.jit(fn).lower(*abstract_args)
    timing.lower_ms = (clock() - start) * 1e3
    start = clock()
    compiled = lowered.compile()
    timing.compile_ms = (clock() - start) * 1e3
    if preflight is not None:
        preflight(compiled)

    def on_device(i: int) -> list[Any]:
        return sync([jax.device_put(x) for x in make_inputs(i)])

    for w in range(warmups):
        sync(compiled(*on_device(-1 - w)))
    digests = []
    for i in range(samples):
        start = clock()
        args = on_device(i)
        if i == 0:
            timing.transfer_ms = (clock() - start) * 1e3
        start = clock()
        out = compiled(*args)
        sync(out)
        timing.samples_ms.append((clock() - start) * 1e3)
        digests.append(output_digest(out))
        del out, args
    for i in checked_samples(samples, entropy, key, checked):
        host = make_inputs(i)
        out = sync(compiled(*[jax.device_put(x) for x in host]))
        if output_digest(out) != digests[i]:
            passed, detail = False, "the output differs from the timed call's on the same inputs (nondeterministic)"
        else:
            passed, detail = check(i, host, out)
        timing.output_checks.append({"sample": i, "passed": bool(passed), "detail": str(detail)[:500]})
    return timing


def roofline_floor_ms(flops: float | None, bytes_moved: float | None, device_kind: str) -> float | None:
    """The least time ``flops`` and ``bytes_moved`` take at the device's peak rates, in ms."""
    peak = roofline.device_peak(device_kind)
    if peak is None or flops is None or bytes_moved is None:
        return None
    return 1e3 * max(flops / peak.flops_per_s, bytes_moved / peak.bytes_per_s)
