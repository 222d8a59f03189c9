"""The contracts the rubric grades, each declared once: adding one is a folder beside ``dense/``, ``paged/`` and
``ragged/`` (slots, problems, truth, checks, known_bad, signature) and one line in :data:`CONTRACTS`.

The rubric, ``tpu-kernel-rubric`` and ``measure --candidate`` (their flags), export, and the builder's
``graded-contract`` rule ask this registry which checks, built-ins, features and call signatures a contract
has, instead of naming a contract themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ..grading.candidate import Candidate
from ..grading.check_context import CheckSpec
from ..grading.dense import feature_checks as dense_checks
from ..grading.dense.checks import CHECKS
from ..grading.dense.known_bad import BUILTIN
from ..grading.dense.signature import ProgramAttention, Signature
from ..grading.paged.checks import PAGED_CHECKS, paged_checks_for
from ..grading.paged.known_bad import PAGED_BUILTIN
from ..grading.paged.signature import PagedSignature, ProgramPagedAttention
from ..grading.programs import Programs
from ..grading.ragged.checks import RAGGED_CHECKS, ragged_checks_for
from ..grading.ragged.known_bad import RAGGED_BUILTIN
from ..grading.ragged.signature import ProgramRaggedAttention, RaggedSignature
from kernel_src.contract import FEATURES, PAGED_FEATURES, RAGGED_FEATURES


@dataclass(frozen=True, eq=False)  # one object per contract: hashed and compared by identity
class Contract:
    """One contract: what a kernel of it is called as, and everything the grader knows of it.

    ``name`` is what scorecards, records and ``Candidate.contract`` say; ``folder`` its sub-package of
    ``grading/``; ``flag`` the command-line flag that selects it (None: the default contract, no flag)."""

    name: str
    folder: str
    function: str                      # kernel_src.contract's function of this contract
    signature: str                     # how a kernel of it is called (without the features' arguments)
    features: tuple[str, ...]          # the features a kernel of it may declare (kernel_src.contract)
    checks: tuple[CheckSpec, ...]      # the base checks (before ``finite``)
    checks_for: Callable[[Sequence[str]], tuple[CheckSpec, ...]]  # the base checks, then each feature's
    check_prefix: str                  # a feature f's check is named check_prefix + f
    builtins: Mapping[str, Candidate]  # its built-in candidates by name
    signature_type: type               # how export describes one call (``of_call``, ``to_dict``, ``from_dict``)
    program_type: type[Programs]       # a submission's stored programs, called as a kernel of it
    flag: str | None = None
    flag_help: str = ""
    plan_checks: Callable[[int, str, Sequence[str]], None] | None = None  # builds its problems ahead, if it can

    def reference(self) -> Callable:
        """The contract's reference (its built-in of kind "reference"), loaded."""
        return next(c for c in self.builtins.values() if c.kind == "reference").load()


DENSE = Contract(
    "attention", "dense", "attention", "attention(q, k, v, *, causal=False, kv_lengths=None, scale=None)",
    FEATURES, CHECKS, dense_checks.checks_for, "", BUILTIN, Signature, ProgramAttention,
    plan_checks=dense_checks.plan_checks)
PAGED = Contract(
    "paged", "paged", "paged_attention",
    "paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, scale=None, causal=True)",
    PAGED_FEATURES, PAGED_CHECKS, paged_checks_for, "paged-", PAGED_BUILTIN, PagedSignature, ProgramPagedAttention,
    flag="--paged", flag_help="grade against the paged contract (kernel_src.contract: paged_attention(q, k_pages, "
                              "v_pages, *, kv_lengths, page_indices, ...)) with the paged checks instead of the "
                              "dense one; the paged built-ins (paged-*) are always graded so")

RAGGED = Contract(
    "ragged", "ragged", "ragged_paged_attention",
    "ragged_paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, cu_q_lens, num_seqs, scale=None, "
    "causal=True)", RAGGED_FEATURES, RAGGED_CHECKS, ragged_checks_for, "ragged-", RAGGED_BUILTIN, RaggedSignature,
    ProgramRaggedAttention, flag="--ragged", flag_help="grade against the ragged paged contract (kernel_src.contract: "
    "ragged_paged_attention(q, k_pages, v_pages, *, kv_lengths, page_indices, cu_q_lens, num_seqs, ...)) with the "
    "ragged checks; the ragged built-ins (ragged-*) are always graded so")

CONTRACTS: dict[str, Contract] = {c.name: c for c in (DENSE, PAGED, RAGGED)}
DEFAULT = DENSE  # a candidate's contract when it names none, and what a scorecard without ``contract`` graded


def get(name: str | None) -> Contract:
    """The contract named ``name`` (None: :data:`DEFAULT`); ValueError naming the contracts otherwise."""
    if name is None:
        return DEFAULT
    if name not in CONTRACTS:
        raise ValueError(f"unknown contract {name!r}: one of {', '.join(CONTRACTS)}")
    return CONTRACTS[name]


def of(candidate: Candidate, asked: str | None = None) -> Contract:
    """The contract ``candidate`` is graded on: its own where it is not the default's (a paged built-in),
    else ``asked`` (None: the default)."""
    return CONTRACTS[candidate.contract] if candidate.contract != DEFAULT.name else get(asked)


def flagged(options: Any) -> str | None:
    """The contract an argparse namespace's flag selects (``--paged``: ``"paged"``), else None."""
    chosen = [c.name for c in CONTRACTS.values() if c.flag and getattr(options, _dest(c.flag), False)]
    if len(chosen) > 1:
        raise ValueError(f"choose one contract: {' or '.join(CONTRACTS[n].flag for n in chosen)}")
    return chosen[0] if chosen else None


def add_flags(parser, help_of: Callable[[Contract], str] = lambda c: c.flag_help) -> None:
    """Add each flagged contract's flag (``--paged``) to an argparse parser (store_true)."""
    for c in CONTRACTS.values():
        if c.flag:
            parser.add_argument(c.flag, action="store_true", help=help_of(c))


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def signature_from_dict(d: dict[str, Any]):
    """The signature a dict describes, of the contract it names (``contract``; absent: the default's)."""
    return get(d.get("contract", DEFAULT.name)).signature_type.from_dict(d)
