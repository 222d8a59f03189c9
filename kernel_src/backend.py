"""Which Pallas lowering to use: interpret mode on CPU, Mosaic on TPU, Triton/Mosaic-GPU on GPU."""

from __future__ import annotations

import jax


def platform() -> str:
    """The default backend's platform: ``"cpu"``, ``"tpu"`` or ``"gpu"``."""
    return jax.default_backend()


def resolve_interpret(interpret=None):
    """``interpret`` as given, else ``True`` on CPU (no Pallas compiler there) and ``False`` elsewhere.

    Any value that ``pl.pallas_call(interpret=...)`` accepts passes through unchanged, e.g.
    ``pltpu.InterpretParams(...)`` for TPU interpret mode.
    """
    if interpret is not None:
        return interpret
    return platform() == "cpu"
