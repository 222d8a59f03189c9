"""Every attention implementation of the project, declared once.

The benchmark (``bench.cases``), the rubric's built-in candidates (``grading.candidates``), the
dataset card and the tests read this table instead of keeping their own lists of names.

Example::

    from kernel_src.registry import IMPLEMENTATIONS
    flash = IMPLEMENTATIONS["flash"].load()   # kernel_src.flash.flash_attention
    out = flash(q, k, v, causal=True)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import Any, Callable, Literal

Kind = Literal["reference", "kernel", "vendor"]


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One attention implementation.

    Attributes:
      name: its name in benchmark case ids and records (``"xla"``, ``"pallas"``, ...).
      target: ``"module:attribute"`` of the callable, imported only by ``load()``.
      kind: ``"reference"`` (the pure-JAX oracle), ``"kernel"`` (this project's Pallas kernels)
        or ``"vendor"`` (a library's kernel, for comparison).
      description: one line for cards and listings.
      scopes: the benchmark scopes (``bench.cases.SCOPES``) that measure it.
      pallas: whether it runs Pallas kernels (interpret mode on CPU).
      grading_name: its built-in candidate name in the rubric, ``None`` if the rubric has none.
      platforms: where it can run at all (``jax.default_backend()`` names), ``None`` for anywhere.
      softmax_target: ``"module:attribute"`` of its masked softmax alone, for the ``softmax``
        scope (``[batch, heads, q_len, kv_len]`` logits in, fp32 probabilities out).
      contract: whether ``load()`` gives ``attention(q, k, v, *, causal, kv_lengths, scale)``;
        ``sharded`` instead takes the contract kernel to shard as its first argument, a paged
        implementation the paged contract's arguments, a ``ragged-*`` one the ragged contract's.
      paged: ``None``, or the pool layout ``load()``'s paged attention takes: ``"pages-first"`` (the
        paged contract's ``paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, ...)``,
        pools ``[num_pages, page_size, num_kv_heads, head_dim]``) or ``"heads-first"`` (JAX's
        ``paged_attention``'s pools ``[num_kv_heads, num_pages, page_size, head_dim]``, otherwise
        the same call): the ``paged-decode`` benchmark scope lays each pool out as its
        implementation reads it, so no kernel is timed with a relayout of the cache; ``"kv-interleaved"``:
        JAX's ``ragged_paged_attention``'s one pool ``[num_pages, page_size, 2 * num_kv_heads, head_dim]``, K
        at even heads and V at odd, passed in place of ``k_pages, v_pages`` (the ``ragged`` scope).
      options: keyword arguments ``load()`` binds to the callable (a kernel family's variant).
    """

    name: str
    target: str
    kind: Kind
    description: str
    scopes: tuple[str, ...]
    pallas: bool
    grading_name: str | None = None
    platforms: tuple[str, ...] | None = None
    softmax_target: str | None = None
    contract: bool = True
    options: tuple[tuple[str, Any], ...] = ()
    paged: Literal["pages-first", "heads-first", "kv-interleaved"] | None = None

    def load(self) -> Callable[..., Any]:
        """The callable itself (imports its module now), with ``options`` bound; a bound one
        keeps the features the callable declares (``kernel_src.contract.supports``)."""
        fn = _resolve(self.target)
        if not self.options:
            return fn
        bound = functools.partial(fn, **dict(self.options))
        if hasattr(fn, "features"):
            bound.features = fn.features
        return bound

    def load_softmax(self) -> Callable[..., Any]:
        """The masked softmax of the ``softmax`` scope; ``ValueError`` if it has none."""
        if self.softmax_target is None:
            raise ValueError(f"implementation {self.name!r} has no separate masked softmax")
        return _resolve(self.softmax_target)

    def runs_on(self, platform: str) -> bool:
        return self.platforms is None or platform in self.platforms


def _resolve(target: str) -> Callable[..., Any]:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


IMPLEMENTATIONS: dict[str, Implementation] = {impl.name: impl for impl in (
    Implementation(
        "xla", "kernel_src.reference:reference_attention", "reference",
        "Pure-JAX oracle of the contract: XLA matmuls, fp32 logits, softmax and accumulation.",
        scopes=("softmax", "attention", "flash"), pallas=False, grading_name="reference",
        softmax_target="kernel_src.reference:reference_masked_softmax"),
    Implementation(
        "pallas", "kernel_src.attention:pallas_attention", "kernel",
        "Pallas masked softmax (and its backward) between XLA's two matmuls.",
        scopes=("softmax", "attention"), pallas=True, grading_name="pallas",
        softmax_target="kernel_src.masked_softmax:masked_softmax"),
    Implementation(
        "flash", "kernel_src.flash:flash_attention", "kernel",
        "Fused Pallas flash attention: online softmax forward, log-sum-exp backward.",
        scopes=("flash",), pallas=True, grading_name="flash"),
    Implementation(
        "flash-triton", "kernel_src.flash:flash_attention", "kernel",
        "The flash kernels' GPU family (variant='triton', in-kernel loops), graded in interpret mode on a "
        "CPU; on a GPU the flash entry runs it compiled.",
        scopes=(), pallas=True, grading_name="flash-triton", platforms=("cpu", "gpu"),
        options=(("variant", "triton"),)),
    Implementation(
        "cudnn", "kernel_src.vendor:cudnn_attention", "vendor",
        "cuDNN fused attention via jax.nn.dot_product_attention(implementation='cudnn').",
        scopes=("flash",), pallas=False, platforms=("gpu",)),
    Implementation(
        "sharded", "kernel_src.sharded:sharded_attention", "kernel",
        "Any contract kernel under shard_map, batch and kv-head groups split over devices.",
        scopes=("sharded",), pallas=False, contract=False),
    # The paged contract (kernel_src.contract.paged_attention): decode over a paged KV cache.
    Implementation(
        "paged-xla", "kernel_src.reference:reference_paged_attention", "reference",
        "Pure-JAX paged reference: gather each sequence's pages through its table, then attend (XLA).",
        scopes=("paged-decode",), pallas=False, grading_name="paged-reference", contract=False,
        paged="pages-first"),
    Implementation(
        "paged-pallas", "kernel_src.paged:paged_attention_tpu", "kernel",
        "Pallas TPU paged decode kernel: page table in scalar prefetch, pages DMA'd into VMEM "
        "(interpret mode on a CPU).",
        scopes=("paged-decode",), pallas=True, grading_name="paged-pallas", platforms=("cpu", "tpu"),
        contract=False, paged="pages-first"),
    Implementation(
        "paged-triton", "kernel_src.paged:paged_attention_triton", "kernel",
        "The paged kernel's GPU family (Triton): keys gathered through the page table with masked loads.",
        scopes=("paged-decode",), pallas=True, grading_name="paged-triton", platforms=("gpu",),
        contract=False, paged="pages-first"),
    Implementation(
        "jax-paged", "kernel_src.vendor:jax_paged_attention", "vendor",
        "JAX's Pallas TPU paged_attention (jax.experimental.pallas.ops.tpu.paged_attention) on its own "
        "[kv heads, pages, page_size, head_dim] pools; q_len 1, no window.",
        scopes=("paged-decode",), pallas=True, platforms=("tpu",), contract=False, paged="heads-first"),
    # The ragged contract (kernel_src.contract.ragged_paged_attention): one call per serving step.
    Implementation(
        "ragged-xla", "kernel_src.reference:reference_ragged_paged_attention", "reference",
        "Pure-JAX ragged reference: every row gathers its sequence's whole table, then attends (XLA).",
        scopes=("ragged",), pallas=False, grading_name="ragged-reference", contract=False, paged="pages-first"),
    Implementation(
        "ragged-pallas", "kernel_src.ragged:ragged_paged_attention_tpu", "kernel",
        "Pallas TPU ragged paged attention: the step's work list and page table in scalar prefetch, only "
        "the pages each row block sees DMA'd, int8/fp8 pages dequantized in VMEM (interpret mode on a CPU).",
        scopes=("ragged",), pallas=True, grading_name="ragged-pallas", platforms=("cpu", "tpu"), contract=False,
        paged="pages-first"),
    Implementation(
        "ragged-triton", "kernel_src.ragged:ragged_paged_attention_triton", "kernel",
        "The ragged kernel's GPU family (Triton): each row block's visible keys gathered through the page "
        "table with masked loads, dequantized in registers.",
        scopes=("ragged",), pallas=True, grading_name="ragged-triton", platforms=("gpu",), contract=False,
        paged="pages-first"),
    Implementation(
        "jax-ragged", "kernel_src.vendor:jax_ragged_paged_attention", "vendor",
        "JAX's Pallas TPU ragged_paged_attention (jax.experimental.pallas.ops.tpu.ragged_paged_attention) on its "
        "own pool, K and V interleaved by head; causal, its tuned block sizes.",
        scopes=("ragged",), pallas=True, platforms=("tpu",), contract=False, paged="kv-interleaved"),
)}


def for_scope(scope: str, platform: str) -> list[Implementation]:
    """The implementations ``scope`` measures on ``platform``, in declaration order."""
    return [impl for impl in IMPLEMENTATIONS.values()
            if scope in impl.scopes and impl.runs_on(platform)]


def by_grading_name(name: str) -> Implementation | None:
    """The implementation the rubric calls ``name`` (e.g. ``"reference"`` is ``"xla"``)."""
    return next((impl for impl in IMPLEMENTATIONS.values() if impl.grading_name == name), None)
