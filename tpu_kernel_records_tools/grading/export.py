"""A submitted kernel as programs, for every contract: the names ``measure``, ``contribute`` and the builder use.

The machinery is ``grading.programs`` (export in the sandbox, checks on the bytes, :class:`Programs`); how a
call is described is each contract's (``grading.dense.signature``, ``grading.paged.signature``); which
contract a stored signature is of, ``grading.contracts``.
"""

from __future__ import annotations

from typing import Any

from ..grading.contracts import signature_from_dict
from ..grading.dense.signature import ProgramAttention, Signature  # noqa: F401  (re-exported)
from ..grading.paged.signature import PagedSignature, ProgramPagedAttention  # noqa: F401  (re-exported)
from ..grading.programs import (ALLOWED_CUSTOM_CALLS, EXPORT_LIMIT_S, PROGRAM_LIMIT_BYTES,  # noqa: F401
                                ProgramRefused, Programs, _one_line, custom_calls, export_signatures, load_program,
                                program_path, sha256)


def export_programs(fn, signatures: list[dict[str, Any]], platform: str) -> tuple[dict, list]:
    """The worker's ``export`` op: each signature's (a ``to_dict``) serialized program as a uint8 array, or
    the first failure as ``{"ok": False, "error": ...}``."""
    return export_signatures(fn, [signature_from_dict(raw) for raw in signatures], platform)
