"""StableHLO evidence: the program each case ran, gzipped deterministically into the run folder.

The text shows where a Pallas custom call sits between XLA's matrix multiplications. On a CPU the
Pallas cases are also exported for TPU (``jax.export`` with ``platforms=["tpu"]``, no TPU needed).
It is the very program that was timed: the kernels choose their lowering when lowered
(``kernel_src.backend.per_platform``), so the export holds the Mosaic kernels with their TPU
tiles, and a CPU run still records what the TPU would be given.
"""

from __future__ import annotations

import gzip
from typing import Any, Callable, Sequence

import jax
import jax.export  # noqa: F401 - makes jax.export available on jax 0.6.2 too

STABLEHLO_DIR = "stablehlo"


def gzip_text(text: str) -> bytes:
    """gzip bytes of ``text`` with no timestamp or file name, so equal text gives equal bytes."""
    return gzip.compress(text.encode(), compresslevel=9, mtime=0)


def stablehlo_path(case_id: str, suffix: str = "") -> str:
    """Relative path of a case's gzipped StableHLO, e.g. ``stablehlo/attention-xla-s128.mlir.gz``."""
    return f"{STABLEHLO_DIR}/{case_id}{suffix}.mlir.gz"


def lowered_text(lowered: Any) -> str:
    """StableHLO text of a ``jax.jit(f).lower(...)`` result."""
    return lowered.as_text()


def tpu_export_text(fn: Callable[..., Any], abstract_args: Sequence[Any]) -> str:
    """StableHLO of ``jax.jit(fn)`` exported for TPU from whatever machine this is.

    ``fn`` is called with the default lowering choice (no ``interpret=``), as the benchmark runs it.
    """
    exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*abstract_args)
    return exported.mlir_module()
