"""Where a submitted kernel of a contract other than the dense one is timed, and how its timed calls are judged.

The paged and ragged contracts each have benchmark scopes of their own (``paged-decode``, ``ragged``:
``bench.profiles``). A submission of one is timed forward only at those scopes' cases, each at the shape and
pool layout of a template implementation's case (the XLA reference's, laid out as the contract's call), and
each timed call's output is judged by the contract's row check (``measure.timed_checks``). A case that uses a
feature (a window, a quantized cache: ``builder.verdicts.features_used``) is timed only for a kernel that
declares it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..bench.profiles import PAGED_SCOPES, RAGGED_SCOPES
from ..bench.ragged_profiles import QUANTIZED_SCALES
from ..grading import contracts
from ..grading.paged.signature import PagedSignature
from ..grading.ragged.signature import RaggedSignature
from .timed_checks import check_paged_output, check_ragged_output

if TYPE_CHECKING:
    from ..bench.cases import Case


@dataclass(frozen=True)
class TimedContract:
    """A contract's timed scopes: ``templates`` are the implementations whose cases give a submission's timed
    shapes, the first found at a shape winning; ``models`` the profile's field that lists the scopes' models;
    ``check(sig, host, out, rng=)`` judges one timed call's output."""

    scopes: tuple[str, ...]
    templates: tuple[str, ...]
    models: str
    check: Callable[..., tuple[bool, str]]


TIMED = {
    contracts.PAGED.name: TimedContract(PAGED_SCOPES, ("paged-xla",), "paged", check_paged_output),
    # the XLA reference is left out of a step too big for it (bench.ragged_profiles): the project's kernel there
    contracts.RAGGED.name: TimedContract(RAGGED_SCOPES, ("ragged-xla", "ragged-pallas", "ragged-triton"), "ragged",
                                         check_ragged_output),
}
BY_SCOPE = {scope: timed for timed in TIMED.values() for scope in timed.scopes}


def case_signature(case: Case) -> PagedSignature | RaggedSignature:
    """The call a paged or ragged case makes, as export describes it; pools laid out as the contract's."""
    scale = case.shape["head_dim"] ** -0.5
    if case.scope in PAGED_SCOPES:  # (q, k_pages, v_pages, kv_lengths, page_indices)
        q, k_pages, v_pages, lengths, table = case.abstract_args
        return PagedSignature.of_call(q, k_pages, v_pages, kv_lengths=lengths, page_indices=table, causal=case.causal,
                                      scale=scale, window_size=case.window)
    q, k_pages, v_pages, lengths, table, cu_q_lens, num_seqs = case.abstract_args
    return RaggedSignature.of_call(q, k_pages, v_pages, kv_lengths=lengths, page_indices=table, cu_q_lens=cu_q_lens,
                                   num_seqs=num_seqs, causal=case.causal, scale=scale, window_size=case.window,
                                   **dict(zip(("k_scale", "v_scale"), scale_args(case))))


def scale_args(case: Case) -> tuple[np.float32, ...]:
    """What a submitted program takes after a case's inputs: a quantized ragged step's ``k_scale`` and ``v_scale``,
    which the step's implementations are given as Python floats (``bench.ragged_profiles.QUANTIZED_SCALES``) and a
    program as 0-d float32 arguments (``RaggedSignature``); nothing for any other case."""
    if case.scope in RAGGED_SCOPES and case.quantized_kv:
        return tuple(np.float32(x) for x in QUANTIZED_SCALES)
    return ()
