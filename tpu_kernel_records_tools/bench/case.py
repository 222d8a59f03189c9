"""What every benchmark scope's cases are made of: ``Case`` (one measured function at one shape), ``Pair``
(numerator over denominator), the registry's implementations by name and how each scope pairs them
(``pair_cases``). ``bench.cases`` and ``bench.ragged_cases`` expand profiles into them."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable, Sequence

import jax
import numpy as np

from ..bench.profiles import Window
from kernel_src.registry import IMPLEMENTATIONS, Implementation


@dataclasses.dataclass(frozen=True)
class Case:
    """One measured function at one shape.

    ``fn(*args)`` is what is jitted and timed. Its kernels pick their lowering when lowered
    (interpret mode on CPU, Mosaic on TPU), so ``tpu_fn`` is ``fn`` itself where a CPU run also
    exports the case's StableHLO for TPU, ``None`` where there is nothing Pallas to export.
    ``make_inputs()`` returns host (numpy) arrays matching ``abstract_args``. ``model``, ``window``,
    ``softcap``, ``segments`` (documents per row) and ``sinks`` (``True``) describe a ``masks-*``
    case's mask (``model`` and ``window`` also a ``paged-decode`` case's, ``model`` a ``ragged``
    one's); ``page_size``, ``pages`` (table entries per sequence) and ``pool_pages`` a
    ``paged-decode`` or ``ragged`` case's cache; ``num_seqs``, ``q_rows`` (the sequences' new rows,
    padding not counted), ``kv_dtype`` and ``quantized_kv`` a ``ragged`` case's step; ``None`` for
    every other case.
    """

    case_id: str
    scope: str
    implementation: str
    seq_len: int
    shape: dict[str, int]
    dtype: str
    causal: bool
    padded: bool
    interpret: bool
    fn: Callable[..., Any]
    abstract_args: tuple[jax.ShapeDtypeStruct, ...]
    make_inputs: Callable[[], list[np.ndarray]]
    flops: float
    bytes_moved: float
    tpu_fn: Callable[..., Any] | None = None
    mesh_devices: int | None = None
    model: str | None = None
    window: Window | None = None
    softcap: float | None = None
    segments: int | None = None
    sinks: bool | None = None
    page_size: int | None = None
    pages: int | None = None
    pool_pages: int | None = None
    num_seqs: int | None = None
    q_rows: int | None = None
    kv_dtype: str | None = None
    quantized_kv: bool | None = None

    def mask_fields(self) -> dict[str, Any]:
        """The case record's mask, paged-cache and ragged-step fields (``benchmark.schema.json``):
        ``window`` as ``[left, right]``."""
        return dict(model=self.model, window=None if self.window is None else list(self.window),
                    softcap=self.softcap, segments=self.segments, sinks=self.sinks,
                    page_size=self.page_size, pages=self.pages, pool_pages=self.pool_pages,
                    num_seqs=self.num_seqs, q_rows=self.q_rows, kv_dtype=self.kv_dtype,
                    quantized_kv=self.quantized_kv)


@dataclasses.dataclass(frozen=True)
class Pair:
    """Numerator over denominator at one scope and sequence; ``devices`` for a scaling pair."""

    scope: str
    seq_len: int
    numerator: str
    denominator: str
    devices: int | None = None


def seeded_rng(seed: int, scope: str, seq: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, zlib.crc32(scope.encode()), seq]))


def registered(name: str) -> Implementation:
    try:
        return IMPLEMENTATIONS[name]
    except KeyError:
        raise ValueError(f"unknown implementation {name!r}; choose from {sorted(IMPLEMENTATIONS)}") from None


def uses_pallas(impl: str) -> bool:
    return registered(impl.split("@")[0]).pallas


def declares(impl: str, features: Sequence[str]) -> bool:
    """Whether ``impl``'s callable declares every one of ``features`` (``kernel_src.contract``)."""
    from kernel_src.contract import declared_features

    return not features or set(features) <= set(declared_features(registered(impl).load()))


def pair_cases(scope: str, seq: int, ids: dict[str, str]) -> list[Pair]:
    """Every implementation over the reference, then every kernel over every vendor kernel."""
    if scope == "sharded":
        one, *many = sorted(ids, key=lambda impl: int(impl.split("@")[1]))
        return [Pair(scope, seq, ids[impl], ids[one], devices=int(impl.split("@")[1]))
                for impl in many]
    kinds = {name: IMPLEMENTATIONS[name].kind for name in ids}
    reference = next((name for name, kind in kinds.items() if kind == "reference"), None)
    pairs = [Pair(scope, seq, ids[name], ids[reference]) for name in ids
             if reference is not None and name != reference]
    return pairs + [Pair(scope, seq, ids[kernel], ids[vendor])
                    for kernel in ids if kinds[kernel] == "kernel"
                    for vendor in ids if kinds[vendor] == "vendor"]


class LazyFn:
    """Resolves the implementation at the first call, so a missing kernel fails its case only."""

    def __init__(self, factory: Callable[[], Callable[..., Any]]):
        self.factory = factory

    def __call__(self, *args):
        return self.factory()(*args)
