"""Benchmark profiles: the scopes, and the shapes and defaults a run measures.

A profile (``Profile``, ``PROFILES``) names the batch, heads, head dim, dtype and sequence lengths of the
small scopes, and the model-sized shapes of the others: ``ModelShapes`` for the ``model-*`` scopes,
the masked models (``MaskedModel``, ``MODEL_MASKS``, ``TINY_MASKS``) of the ``masks-*`` scopes and the
paged decode steps (``PagedModel``, ``MODEL_PAGED``, ``TINY_PAGED``) of ``paged-decode`` and the serving
steps (``RaggedModel``, ``MODEL_RAGGED``, ``TINY_RAGGED``, from ``bench.ragged_profiles``) of ``ragged``. What each
scope measures, and the cases a profile expands to, are ``bench.cases``'.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from ..bench import roofline
from ..bench.ragged_profiles import MODEL_RAGGED, TINY_RAGGED, RaggedModel

MODEL_SCOPES = ("model-fwd", "model-fwd-bwd")
MASK_SCOPES = ("masks-fwd", "masks-fwd-bwd")
PAGED_SCOPES = ("paged-decode",)
RAGGED_SCOPES = ("ragged",)
SCOPES = ("softmax", "attention", "flash", "sharded") + MODEL_SCOPES + MASK_SCOPES + PAGED_SCOPES + RAGGED_SCOPES
PUBLISHED_SEQ_LENS = (128, 256, 512, 1024, 2048)


@dataclasses.dataclass(frozen=True)
class ModelShapes:
    """The model-sized cases of the ``model-*`` scopes (causal, unpadded, the profile's dtype).

    Attributes:
      batch: sequences per call.
      heads: ``(num_q_heads, num_kv_heads)`` pairs: grouped-query (32 / 8) and multi-head (16 / 16).
      head_dim: per head.
      seq_lens: ``q_len == kv_len``.
      xla_max_logit_bytes: the XLA reference (fp32 logits ``[batch, q_heads, seq, seq]`` in HBM)
        is measured where its logits' bytes, doubled for ``model-fwd-bwd``, stay within this. At
        8 GiB it fits a v5e's 16 GB HBM: compiled for v5e with libtpu (predicted, not measured),
        the reference at batch 8, 16 / 16 heads, seq 4096 needs 8.7 GB of temporaries forward and
        17.0 GB (over v5e's 15.75 GB) forward + backward; at 32 / 8 heads, seq 2048, 4.4 and
        8.7 GB.
    """

    batch: int = 8
    heads: tuple[tuple[int, int], ...] = ((32, 8), (16, 16))
    head_dim: int = 128
    seq_lens: tuple[int, ...] = (2048, 4096, 8192, 16384)
    xla_max_logit_bytes: int = 8 * 2 ** 30

    def xla_fits(self, scope: str, num_q_heads: int, seq: int) -> bool:
        """Whether the XLA reference is measured in ``scope`` at ``num_q_heads`` and ``seq``."""
        passes = 2 if scope == "model-fwd-bwd" else 1
        return passes * 4 * self.batch * num_q_heads * seq * seq <= self.xla_max_logit_bytes


MODEL_SHAPES = ModelShapes()

Window = tuple[int | None, int | None]


@dataclasses.dataclass(frozen=True)
class MaskedModel:
    """One model's attention mask at the sizes it runs: a case per sequence length (and per
    document count, for packed rows) of the ``masks-*`` scopes. Causal, unpadded.

    Attributes:
      name: the model (``model`` in the records), e.g. ``mistral-7b``.
      num_q_heads, num_kv_heads, head_dim: its attention's.
      seq_lens: ``q_len == kv_len``.
      window: ``window_size=(left, right)`` of the contract; a config's ``sliding_window=W`` is
        ``(W - 1, 0)``. ``None``: no window.
      softcap: the logit soft-cap, ``None`` for none.
      scale: the logit scale, ``None`` for ``head_dim ** -0.5``.
      sinks: one sink logit per query head (fp32 ``[num_q_heads]``, drawn from the seed).
      documents: packed rows: one case per count of documents per row (segment ids, ``segment_ids``);
        ``()`` for rows of one sequence.
      tokens: tokens per call: ``batch = max(1, tokens // seq)``.
      plan_seq_lens: lengths at which the static v5e plan (``bench.plan``) sets the windowed kernel
        against splash attention's ``LocalMask``; only for a mask of a window alone.
    """

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    seq_lens: tuple[int, ...]
    window: Window | None = None
    softcap: float | None = None
    scale: float | None = None
    sinks: bool = False
    documents: tuple[int, ...] = ()
    tokens: int = 65536
    plan_seq_lens: tuple[int, ...] = ()

    def __post_init__(self):
        if self.plan_seq_lens and (self.window is None or self.softcap or self.sinks or self.documents):
            raise ValueError(f"{self.name}: the plan sets a window alone against splash's LocalMask")

    @property
    def features(self) -> tuple[str, ...]:
        """The contract features the mask uses, in ``kernel_src.contract.FEATURES`` order."""
        return tuple(name for name, used in (("window", self.window is not None),
                                             ("softcap", self.softcap is not None),
                                             ("segments", bool(self.documents)), ("sinks", self.sinks))
                     if used)

    def batch_for(self, seq: int) -> int:
        return max(1, self.tokens // seq)

    def variants(self) -> list[tuple[int, int | None]]:
        """``(seq, documents per row or None)`` of every case, in run order."""
        return [(seq, docs) for seq in self.seq_lens for docs in (self.documents or (None,))]

    def segment_ids(self, seq: int, documents: int) -> np.ndarray:
        """Int32 ``[batch, seq]`` segment ids of packed rows (queries and keys alike): row ``b`` holds
        ``documents`` documents, ids ``0, 1, ...`` in order, their lengths cut at distinct points
        drawn from a generator keyed by the model, length and count alone (never by the run's seed),
        so the case, and its visible pairs, are the same in every run and in the builder."""
        batch = self.batch_for(seq)
        key = zlib.crc32(f"{self.name}/{seq}/{documents}".encode())
        rng = np.random.default_rng(np.random.SeedSequence([key, batch]))
        ids = np.empty((batch, seq), np.int32)
        for b in range(batch):
            cuts = np.sort(rng.choice(np.arange(1, seq), size=documents - 1, replace=False))
            ids[b] = np.searchsorted(cuts, np.arange(seq), side="right")
        return ids


# The models whose masks the tpu-v5e and gpu profiles time (their configs: attention heads, key /
# value heads, head_dim, sliding_window W as window (W - 1, 0), logit soft-cap, sinks).
MODEL_MASKS = (
    # Mistral-7B v0.1: 32 / 8 heads of 128, sliding_window 4096; the plan's windowed rows at 32k.
    MaskedModel("mistral-7b", 32, 8, 128, (8192, 16384, 32768), window=(4095, 0), plan_seq_lens=(32768,)),
    # Gemma 2 9B local layers: 16 / 8 heads of 256, sliding_window 4096, attn_logit_softcapping 50,
    # query_pre_attn_scalar 256 (scale 256 ** -0.5); its context is 8192.
    MaskedModel("gemma-2-9b", 16, 8, 256, (8192,), window=(4095, 0), softcap=50.0, scale=256 ** -0.5),
    # gpt-oss-20b sliding layers: 64 / 8 heads of 64, sliding_window 128, a learned sink per head.
    MaskedModel("gpt-oss-20b", 64, 8, 64, (8192, 32768), window=(127, 0), sinks=True),
    # Packed training rows of 8192 tokens holding 4 and 16 documents (Mistral's / Llama's heads).
    MaskedModel("packed", 32, 8, 128, (8192,), documents=(4, 16)),
)
# The same features at sizes interpret mode runs in seconds (the cpu and tiny profiles): a window
# narrower than the row, a soft-cap, sinks, packed documents.
TINY_MASKS = (
    MaskedModel("mistral-7b-tiny", 4, 2, 64, (256,), window=(63, 0), tokens=256),
    MaskedModel("gemma-2-9b-tiny", 4, 2, 64, (256,), window=(63, 0), softcap=50.0, tokens=256),
    MaskedModel("gpt-oss-20b-tiny", 8, 2, 64, (256,), window=(15, 0), sinks=True, tokens=256),
    MaskedModel("packed-tiny", 4, 2, 64, (256,), documents=(4,), tokens=256),
)


@dataclasses.dataclass(frozen=True)
class PagedModel:
    """One model's decode step over a paged KV cache: a case per page size and context of the
    ``paged-decode`` scope. Causal, one new row per sequence (``q_len`` 1), the profile's dtype.

    Attributes:
      name: the model (``model`` in the records), e.g. ``llama-3-8b``.
      num_q_heads, num_kv_heads, head_dim: its attention's.
      contexts: the longest sequence of a case (``seq_len``, ``kv_len``): ``pages = context //
        page_size`` table entries per sequence.
      page_sizes: keys per page, one case each.
      tokens: cache tokens per case: ``batch = min(max_batch, tokens // context)`` (at least 1).
      max_batch: the largest batch.
      window: the contract's ``window_size`` (a config's ``sliding_window=W`` is ``(W - 1, 0)``);
        ``None``: none. Pages before the window hold no key a new row sees.
      plan: whether the static v5e plan (``bench.plan``) sets the paged kernel against JAX's
        ``paged_attention`` at these cases' shapes (only without a window: JAX's has none).
    """

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    contexts: tuple[int, ...]
    page_sizes: tuple[int, ...] = (16, 128)
    tokens: int = 262144
    max_batch: int = 64
    window: Window | None = None
    plan: bool = False

    def __post_init__(self):
        for context in self.contexts:
            for page_size in self.page_sizes:
                if context % page_size:
                    raise ValueError(f"{self.name}: context {context} is no multiple of page size {page_size}")
        if self.plan and self.window is not None:
            raise ValueError(f"{self.name}: the plan's peer, JAX's paged_attention, has no window")

    @property
    def features(self) -> tuple[str, ...]:
        return ("window",) if self.window is not None else ()

    def batch_for(self, context: int) -> int:
        return max(1, min(self.max_batch, self.tokens // context))

    def variants(self) -> list[tuple[int, int]]:
        """``(context, page_size)`` of every case, in run order."""
        return [(context, page_size) for context in self.contexts for page_size in self.page_sizes]

    def lengths(self, context: int) -> np.ndarray:
        """Int32 ``[batch]`` key lengths: sequence 0 holds the whole context, the others distinct ragged
        lengths in ``(context / 2, context)`` (``context - (7919 b mod context / 2)``): last pages partly
        filled at either page size. A function of the case alone, so its useful bytes are."""
        batch = self.batch_for(context)
        return np.array([context - (7919 * b) % (context // 2) for b in range(batch)], np.int32)

    def page_table(self, context: int, page_size: int) -> tuple[np.ndarray, int]:
        """``(page_indices int32 [batch, pages], pool_pages)``: every sequence's pages, distinct and in a
        random order (a generator keyed by the model and case alone) over a pool of ``batch * pages``
        pages, as a serving engine's allocator leaves them."""
        batch, pages = self.batch_for(context), context // page_size
        key = zlib.crc32(f"{self.name}/{context}/{page_size}".encode())
        rng = np.random.default_rng(np.random.SeedSequence([key, batch]))
        return rng.permutation(batch * pages).reshape(batch, pages).astype(np.int32), batch * pages

    def work(self, context: int, itemsize: int) -> tuple[float, float]:
        """``(flops, useful bytes)`` of a case (``bench.roofline.paged_work``)."""
        return roofline.paged_work(self.lengths(context), 1, self.num_q_heads, self.num_kv_heads,
                                   self.head_dim, itemsize, True, self.window)


# The decode steps the tpu-v5e and gpu profiles time: Llama-3-8B (32 / 8 heads of 128) at 1k-32k keys, batch
# 64-8 (262,144 cache tokens), and Mistral-7B v0.1 (the same heads) with its sliding_window 4096 at 8k-32k.
MODEL_PAGED = (
    PagedModel("llama-3-8b", 32, 8, 128, (1024, 8192, 32768), plan=True),
    PagedModel("mistral-7b", 32, 8, 128, (8192, 32768), window=(4095, 0)),
)
# The same at sizes interpret mode runs in seconds (the cpu profile; the tiny profile the windowed one alone):
# pages of 16 and 128, a window.
TINY_PAGED = (
    PagedModel("llama-3-8b-tiny", 4, 2, 128, (256,), tokens=512, max_batch=2),
    PagedModel("mistral-7b-tiny", 4, 2, 128, (256,), page_sizes=(16,), tokens=512, max_batch=2, window=(63, 0)),
)


@dataclasses.dataclass(frozen=True)
class Profile:
    """Shapes and defaults of a benchmark run.

    Attributes:
      seq_lens: sequence lengths (``q_len == kv_len``) of every scope.
      long_seq_lens: extra lengths for the ``flash`` and ``sharded`` scopes only.
      max_tokens: cap on ``batch * seq`` for the scopes that run the XLA reference (its fp32
        logits grow with ``seq**2``); the batch shrinks, never below 1, for longer sequences.
      sharded_kernel: the contract kernel the ``sharded`` scope shards (``flash``, ``pallas`` or
        ``xla``).
      export_tpu: on a CPU, also export the Pallas cases' StableHLO for TPU.
      grade_known_bad: whether ``measure`` also grades every known-bad built-in (quick level, one
        worker each: about 20 s apiece on a 2-core CPU) to show the rubric still rejects them here.
      kernel_level: the rubric level ``measure`` grades the measured kernels at: ``full`` on an
        accelerator; ``quick`` on a CPU, where the kernels are interpreted and the run only shows that
        their path runs (the full level's model-sized problems take minutes per kernel there).
      model: the shapes of the ``model-*`` scopes; ``None`` where the profile has none.
      masks: the masked models of the ``masks-*`` scopes (``MaskedModel``).
      paged: the decode steps of the ``paged-decode`` scope (``PagedModel``).
      ragged: the serving steps of the ``ragged`` scope (``RaggedModel``).
    """

    name: str
    batch: int
    head_dim: int
    seq_lens: tuple[int, ...] = PUBLISHED_SEQ_LENS
    long_seq_lens: tuple[int, ...] = ()
    num_q_heads: int = 4
    num_kv_heads: int = 2
    dtype: str = "bfloat16"
    causal: bool = True
    padded: bool = True
    max_tokens: int | None = None
    scopes: tuple[str, ...] = ("softmax", "attention")
    warmups: int = 5
    samples: int = 20
    sharded_kernel: str = "flash"
    export_tpu: bool = True
    model: ModelShapes | None = None
    grade_known_bad: bool = True
    kernel_level: str = "full"
    masks: tuple[MaskedModel, ...] = ()
    paged: tuple[PagedModel, ...] = ()
    ragged: tuple[RaggedModel, ...] = ()

    def batch_for(self, scope: str, seq: int) -> int:
        if self.max_tokens is None or scope == "sharded":
            return self.batch
        return max(1, min(self.batch, self.max_tokens // seq))

    def seq_lens_for(self, scope: str) -> tuple[int, ...]:
        return self.seq_lens + (self.long_seq_lens if scope in ("flash", "sharded") else ())


PROFILES: dict[str, Profile] = {
    p.name: p for p in (
        # A demonstration on a 2-core CPU, Pallas in interpret mode: lengths to 1024 (an interpreted 2048 is the
        # costliest case of all), 2 warm-ups and 10 samples, its kernels graded at the quick level (the
        # known-bad built-ins, 20 s apiece here, are left to --known-bad and the grader-power record).
        Profile("cpu", batch=1, head_dim=64, seq_lens=PUBLISHED_SEQ_LENS[:-1], warmups=2, samples=10,
                grade_known_bad=False, kernel_level="quick",
                scopes=("softmax", "attention") + MASK_SCOPES + PAGED_SCOPES + RAGGED_SCOPES, masks=TINY_MASKS,
                paged=TINY_PAGED, ragged=TINY_RAGGED),
        Profile("tiny", batch=1, head_dim=64, seq_lens=(128,), warmups=1, samples=5, export_tpu=True,
                grade_known_bad=False, kernel_level="quick", masks=TINY_MASKS, paged=TINY_PAGED[1:],
                ragged=TINY_RAGGED),
        Profile("tpu-v5e", batch=8, head_dim=128, long_seq_lens=(4096, 8192), max_tokens=8 * 2048,
                scopes=SCOPES, model=MODEL_SHAPES, masks=MODEL_MASKS, paged=MODEL_PAGED, ragged=MODEL_RAGGED),
        Profile("gpu", batch=8, head_dim=128, long_seq_lens=(4096, 8192), max_tokens=8 * 2048,
                scopes=SCOPES, model=MODEL_SHAPES, masks=MODEL_MASKS, paged=MODEL_PAGED, ragged=MODEL_RAGGED),
        # scripts/device_check.sh on one NVIDIA H100 (the device tool's), meant to fit its 10 minutes: one GPU (no
        # sharded scope), flash at 1k, 2k and 8k, the model shapes, paged decode and the ragged serving steps; fewer
        # samples, no known-bads.
        Profile("h100", batch=8, head_dim=128, seq_lens=(1024, 2048), long_seq_lens=(8192,),
                max_tokens=8 * 2048, warmups=3, samples=10, grade_known_bad=False,
                scopes=("softmax", "attention", "flash") + MODEL_SCOPES + PAGED_SCOPES + RAGGED_SCOPES,
                model=MODEL_SHAPES, paged=MODEL_PAGED, ragged=MODEL_RAGGED),
    )
}


def default_profile(platform: str) -> str:
    """The profile a platform gets unless told otherwise: ``cpu``, ``tpu-v5e`` or ``gpu``."""
    return {"tpu": "tpu-v5e", "gpu": "gpu"}.get(platform, "cpu")


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; choose from {sorted(PROFILES)}") from None
