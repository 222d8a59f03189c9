"""The serving steps of the ``ragged`` scope: ``RaggedModel``, ``MODEL_RAGGED`` and ``TINY_RAGGED``.

A serving engine's step is one ``ragged_paged_attention`` call (``kernel_src.contract``) over a mix of
sequences: decode rows (``q_len`` 1), chunks of a prefill (``1 < q_len < kv_len``) and whole prompts
(``q_len == kv_len``), their keys in one paged cache stored in bfloat16, or in float8_e4m3fn with a
``k_scale`` and ``v_scale`` (the contract's ``quantized_kv``). ``bench.profiles`` gives each profile its
models; ``bench.ragged_cases`` expands them into cases.
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

from ..bench import roofline

KV_DTYPES = ("bfloat16", "float8_e4m3fn")  # the cache dtypes a step is timed at
KV_ITEMSIZE = {"bfloat16": 2, "float8_e4m3fn": 1}  # bytes per stored element of each
QUANTIZED_SCALES = (0.5, 0.25)  # (k_scale, v_scale) of a float8_e4m3fn cache: a key is float32(stored) * k_scale
TOKEN_MULTIPLE = 16  # q's rows are padded to a multiple, as a serving engine pads a step to its batch bucket


@dataclasses.dataclass(frozen=True)
class RaggedModel:
    """One model's serving step: a case per page size and cache dtype of the ``ragged`` scope. Causal,
    queries in the profile's dtype.

    Attributes:
      name: the model (``model`` in the records), e.g. ``llama-3-8b``.
      num_q_heads, num_kv_heads, head_dim: its attention's.
      decode_rows: sequences decoding one row each.
      decode_context: the longest decode sequence's keys; the others' are distinct and ragged
        (``mix``).
      chunks: ``(q_len, kv_len)`` of each chunk of a prefill: its ``q_len`` new rows end its
        ``kv_len`` keys.
      prompts: keys of each whole prompt prefilled in the step (``q_len == kv_len``).
      page_sizes: keys per page, one case each.
      kv_dtypes: the cache's dtypes, one case each (``KV_DTYPES``); ``float8_e4m3fn`` is quantized
        with ``QUANTIZED_SCALES``.
      plan: whether the static v5e plan sets the ragged kernel against JAX's
        ``ragged_paged_attention`` at this step.
      xla_max_bytes: the XLA reference (``ragged-xla``: every row gathers its sequence's whole table)
        is timed where ``xla_bytes`` stays within this.
    """

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    decode_rows: int
    decode_context: int
    chunks: tuple[tuple[int, int], ...]
    prompts: tuple[int, ...]
    page_sizes: tuple[int, ...] = (16, 128)
    kv_dtypes: tuple[str, ...] = KV_DTYPES
    plan: bool = False
    xla_max_bytes: int = 8 * 2 ** 30

    def __post_init__(self):
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: {self.num_q_heads} query heads are no multiple of "
                             f"{self.num_kv_heads} kv heads")
        if any(not 1 < q_len < kv_len for q_len, kv_len in self.chunks):
            raise ValueError(f"{self.name}: a prefill chunk has 1 < q_len < kv_len, got {self.chunks}")
        unknown = set(self.kv_dtypes) - set(KV_DTYPES)
        if unknown:
            raise ValueError(f"{self.name}: cache dtypes are {KV_DTYPES}, got {sorted(unknown)}")

    def mix(self) -> tuple[np.ndarray, np.ndarray]:
        """``(q_lens, kv_lens)``, int32 ``[num_seqs]``, in row order: the decode rows (the first holds
        ``decode_context`` keys, the others distinct lengths ``decode_context - (7919 i mod
        decode_context / 2)``), then the chunks, then the prompts. A function of the model alone, so
        the case's work is."""
        decode = [self.decode_context - (7919 * i) % (self.decode_context // 2) for i in range(self.decode_rows)]
        q_lens = [1] * self.decode_rows + [q for q, _ in self.chunks] + list(self.prompts)
        kv_lens = decode + [kv for _, kv in self.chunks] + list(self.prompts)
        return np.array(q_lens, np.int32), np.array(kv_lens, np.int32)

    @property
    def rows(self) -> int:
        """Every sequence's new rows: the step's query rows, padding not counted."""
        return int(self.mix()[0].sum())

    @property
    def num_tokens(self) -> int:
        """``q``'s first axis: ``rows`` padded to a multiple of ``TOKEN_MULTIPLE`` (rows past the sequences' are
        the contract's padding: not graded, not counted as work)."""
        return -(-self.rows // TOKEN_MULTIPLE) * TOKEN_MULTIPLE

    @property
    def num_seqs(self) -> int:
        return self.decode_rows + len(self.chunks) + len(self.prompts)

    def max_len(self) -> int:
        """The longest sequence's keys."""
        return int(self.mix()[1].max())

    def page_table(self, page_size: int) -> tuple[np.ndarray, int]:
        """``(page_indices int32 [num_seqs, pages_per_sequence], pool_pages)``: each sequence's
        ``ceil(kv_len / page_size)`` pages, distinct and in a random order over a pool of exactly those
        pages (a generator keyed by the model and page size alone), as a serving engine's allocator
        leaves them; entries past a sequence's last page are 0 (in range, never read)."""
        kv_lens = self.mix()[1]
        pages = -(-kv_lens // page_size)
        pool = int(pages.sum())
        key = zlib.crc32(f"{self.name}/{page_size}".encode())
        order = np.random.default_rng(np.random.SeedSequence([key, pool])).permutation(pool)
        table = np.zeros((len(kv_lens), int(pages.max())), np.int32)
        starts = np.concatenate([[0], np.cumsum(pages)])
        for i, n in enumerate(pages):
            table[i, :n] = order[starts[i]:starts[i + 1]]
        return table, pool

    def work(self, itemsize: int, q_itemsize: int = 2) -> tuple[float, float]:
        """``(flops, least useful bytes)`` of the step (``bench.roofline.ragged_work``): ``itemsize`` is
        the cache's (2 for bfloat16, 1 for float8_e4m3fn), ``q_itemsize`` the queries' and output's."""
        q_lens, kv_lens = self.mix()
        return roofline.ragged_work(q_lens, kv_lens, self.num_q_heads, self.num_kv_heads, self.head_dim,
                                    itemsize, q_itemsize)

    def xla_bytes(self) -> int:
        """What the XLA reference holds at once, about: every row's gathered K and V as float32
        (``[num_tokens, pages_per_sequence * page_size, num_kv_heads, head_dim]``) and its float32
        logits and probabilities, at the longest table (the largest page size's)."""
        span = max(-(-self.max_len() // p) * p for p in self.page_sizes)
        return self.num_tokens * span * (2 * 4 * self.num_kv_heads * self.head_dim + 2 * 4 * self.num_q_heads)

    def xla_fits(self) -> bool:
        return self.xla_bytes() <= self.xla_max_bytes

    def variants(self) -> list[tuple[int, str]]:
        """``(page_size, kv_dtype)`` of every case, in run order."""
        return [(page_size, kv_dtype) for page_size in self.page_sizes for kv_dtype in self.kv_dtypes]


# The steps the tpu-v5e, gpu and h100 profiles time. Llama-3-8B (32 / 8 heads of 128): 64 decode rows at up to 8k
# keys, two 512-row chunks of a prefill (at 2k and 4k keys) and a 1,000-token prompt (2,088 rows, within a
# serving engine's usual 2,048-4,096 batched tokens); its every row gathering an 8k table is too big for the XLA
# reference. A Qwen2.5-7B-shaped step (28 / 4 heads of 128), smaller, where the XLA reference fits.
MODEL_RAGGED = (
    RaggedModel("llama-3-8b", 32, 8, 128, decode_rows=64, decode_context=8192, chunks=((512, 2048), (512, 4096)),
                prompts=(1000,), plan=True),
    RaggedModel("qwen2.5-7b", 28, 4, 128, decode_rows=32, decode_context=2048, chunks=((128, 1024),),
                prompts=(256,), plan=True),
)
# The same mix at sizes interpret mode runs in seconds (the cpu and tiny profiles): two decode rows, a chunk and a
# prompt, pages of 16, both cache dtypes.
TINY_RAGGED = (
    RaggedModel("llama-3-8b-tiny", 4, 2, 128, decode_rows=2, decode_context=64, chunks=((8, 40),), prompts=(24,),
                page_sizes=(16,)),
)
