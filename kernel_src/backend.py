"""Which Pallas lowering to use, chosen when the program is lowered, not when it is traced.

A kernel here is traced once per lowering target and staged out with ``jax.lax.platform_dependent``:
lowered for CPU it runs Pallas in interpret mode, for TPU it is the Mosaic kernel
(``tpu_custom_call``), for CUDA/ROCm the Triton kernel. So ``jax.export(..., platforms=["tpu"])``
from a CPU host holds the Mosaic kernel, and a multi-platform export holds one branch per platform.
An explicit ``interpret=`` still overrides: ``True`` (or ``pltpu.InterpretParams``) interprets
everywhere, ``False`` compiles for TPU/GPU and refuses CPU.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jax_core
from jax.interpreters import batching, mlir

#: The lowering a kernel is built for: ``"cpu"`` = Pallas interpret mode, ``"tpu"`` = Mosaic,
#: ``"gpu"`` = Triton (CUDA and ROCm).
TARGETS = ("cpu", "tpu", "gpu")


class Unsupported(ValueError):
    """A kernel configuration that one lowering target cannot take (e.g. TPU blocks not of 128)."""


def platform() -> str:
    """The default backend's platform: ``"cpu"``, ``"tpu"`` or ``"gpu"``."""
    return jax.default_backend()


def per_platform(build: Callable[[str, Any], Callable[..., Any]], interpret: Any,
                 out: Any, *args: Any) -> Any:
    """``build(target, interpret)(*args)`` with the target chosen per lowering platform.

    Args:
      build: returns the function for one target (see ``TARGETS``), given the ``interpret``
        value to pass to ``pl.pallas_call`` (``False`` for compiled targets); raises
        ``Unsupported`` where the call's configuration cannot run on that target.
      interpret: ``None`` (CPU interprets, TPU/GPU compile), ``False`` (TPU/GPU compile, lowering
        for CPU raises) or anything else ``pallas_call(interpret=...)`` takes (interpret on every
        platform; ``Unsupported`` is then raised here and now).
      out: ``jax.ShapeDtypeStruct`` (or pytree of them) of the result, for refusing branches.
      args: arrays passed to the chosen function.

    A target whose ``build`` raised ``Unsupported`` is still staged out: lowering for it raises
    ``ValueError`` with that message, while every other platform works.
    """
    if interpret is not None and interpret is not False:
        return build("cpu", interpret)(*args)

    def branch(target):
        if target == "cpu" and interpret is False:
            return refusal("interpret=False compiles Pallas, which has no CPU lowering; pass "
                           "interpret=True (or leave it None) to run in interpret mode on CPU", out)
        try:
            return build(target, target == "cpu")
        except Unsupported as error:
            return refusal(f"cannot lower for {target}: {error}", out)

    gpu = branch("gpu")
    return lax.platform_dependent(*args, cpu=branch("cpu"), tpu=branch("tpu"), cuda=gpu, rocm=gpu)


# --- lowering only for some platforms --------------------------------------------------------
# A compiled pallas_call inside a platform_dependent branch would still be lowered for every
# platform of a multi-platform export (and Pallas refuses to compile for CPU). This primitive
# wraps such a call so that its body is lowered for the given platforms only.

_only_for_p = jax_core.Primitive("kernel_src_lowered_only_for")
_only_for_p.multiple_results = True
_only_for_p.def_impl(lambda *args, jaxpr, platforms: jax_core.jaxpr_as_fun(jaxpr)(*args))
_only_for_p.def_abstract_eval(lambda *args, jaxpr, platforms: jaxpr.out_avals)


def _only_for_lowering(ctx, *args, jaxpr, platforms):
    lowering = tuple(ctx.platforms or ctx.module_context.platforms)
    kept = [p for p in lowering if p in platforms]
    if not kept:
        raise ValueError(f"a kernel compiled for {'/'.join(platforms)} cannot be lowered for "
                         f"{'/'.join(lowering)}")
    body = mlir.lower_fun(jax_core.jaxpr_as_fun(jaxpr), multiple_results=True)
    return body(ctx.replace(platforms=kept), *args)


def _only_for_batching(args, dims, *, jaxpr, platforms):
    fn = jax.vmap(jax_core.jaxpr_as_fun(jaxpr), in_axes=dims)
    outs = lowered_only_for(platforms, fn)(*args)
    return outs, [0] * len(outs)


mlir.register_lowering(_only_for_p, _only_for_lowering)
batching.primitive_batchers[_only_for_p] = _only_for_batching


def lowered_only_for(platforms: tuple[str, ...], fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (arrays in, a pytree of arrays out), lowered only for ``platforms`` (e.g. ``("tpu",)``).

    Lowering it for a multi-platform export lowers ``fn`` once, for the platforms it shares with
    the export; lowering it for none of them raises ``ValueError``. Not differentiable: use it
    inside a ``custom_vjp``'s forward and backward.
    """
    def wrapped(*args):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        outs = _only_for_p.bind(*jax.tree.leaves(args), jaxpr=closed, platforms=tuple(platforms))
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
    return wrapped


def compiled_call(platforms: tuple[str, ...], call: Callable[..., Any], interpret: Any
                  ) -> Callable[..., Any]:
    """A ``pl.pallas_call(...)`` callable: as is in interpret mode, else ``lowered_only_for``."""
    if interpret is not None and interpret is not False:
        return call
    return lowered_only_for(platforms, call)


# --- a branch that refuses to lower ----------------------------------------------------------

_refusal_p = jax_core.Primitive("kernel_src_refusal")
_refusal_p.multiple_results = True


def _refuse(*args, message, avals):
    raise ValueError(message)


_refusal_p.def_impl(_refuse)
_refusal_p.def_abstract_eval(lambda *args, message, avals: list(avals))
mlir.register_lowering(_refusal_p, lambda ctx, *args, message, avals: _refuse(message=message,
                                                                              avals=avals))


def _abstract(x) -> jax.core.ShapedArray:
    return jax.core.ShapedArray(x.shape, x.dtype)


def refusal(message: str, out: Any) -> Callable[..., Any]:
    """A differentiable function of any arrays, shaped like ``out``, that raises
    ``ValueError(message)`` when it is run or lowered (not when it is traced)."""
    def refuse_like(like, *args):
        leaves, tree = jax.tree.flatten(like)
        outs = _refusal_p.bind(*args, message=message, avals=tuple(map(_abstract, leaves)))
        return jax.tree.unflatten(tree, outs)

    @jax.custom_vjp
    def refused(*args):
        return refuse_like(out, *jax.tree.leaves(args))

    def fwd(*args):
        return refused(*args), args

    def bwd(args, _):
        floats = [a if a is not None and jnp.issubdtype(a.dtype, jnp.inexact) else None for a in args]
        grads = refuse_like([a for a in floats if a is not None], *jax.tree.leaves(args))
        it = iter(grads)
        return tuple(None if a is None else next(it) for a in floats)

    refused.defvjp(fwd, bwd)
    return refused


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
