"""Which Pallas lowering to use: interpret mode on CPU, Mosaic on TPU, Triton/Mosaic-GPU on GPU."""

from __future__ import annotations

import dataclasses
import importlib

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


def tpu_interpret_params(**overrides):
    """Strict TPU interpret-mode settings, or ``None`` where this JAX has no ``pltpu.InterpretParams``.

    Races are detected and fresh buffers are NaN-filled, so a read of memory no one wrote shows up;
    out-of-bounds reads raise where this JAX accepts ``out_of_bounds_reads`` (jax 0.6.2 does not).
    ``overrides`` are further ``InterpretParams`` fields; an unknown field raises ``TypeError``.
    Pass the result as ``interpret=`` to a kernel in ``kernel_src``.
    """
    from jax.experimental.pallas import tpu as pltpu

    params_cls = getattr(pltpu, "InterpretParams", None)
    if params_cls is None:
        return None
    fields = {f.name for f in dataclasses.fields(params_cls)}
    settings = {"detect_races": True, "uninitialized_memory": "nan"}
    if "out_of_bounds_reads" in fields:
        settings["out_of_bounds_reads"] = "raise"
    settings.update(overrides)
    return params_cls(**settings)


def reset_tpu_interpret_state() -> None:
    """Clear TPU interpret mode's global simulated memory; newer JAX needs this after a kernel raised."""
    from jax.experimental.pallas import tpu as pltpu

    reset = getattr(pltpu, "reset_tpu_interpret_mode_state", None)
    if reset is not None:
        reset()


def tpu_interpret_races_found() -> bool | None:
    """Whether the last TPU interpret-mode run with ``detect_races`` found a data race.

    ``None`` when this JAX keeps no race record where we look (a private module, so this may move).
    """
    for module_name in ("jax._src.pallas.mosaic.interpret.interpret_pallas_call",  # jax >= 0.7
                        "jax._src.pallas.mosaic.interpret"):  # jax 0.6
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        races = getattr(module, "races", None)
        if races is not None:
            return bool(races.races_found)
    return None
