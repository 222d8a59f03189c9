"""grading.contracts: each contract declared once, and what asks it (candidates, the CLI's flags, export's
signatures, the records' schema, the builder's check names) agrees with it."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from tpu_kernel_records_tools.cli import rubric as rubric_cli
from tpu_kernel_records_tools.grading import contracts
from tpu_kernel_records_tools.grading.candidates import builtins, resolve
from tpu_kernel_records_tools.grading.export import PagedSignature, Signature
from tpu_kernel_records_tools.records.rawio import load_schema


def test_every_builtin_is_its_contracts_and_resolves_to_itself():
    for contract in contracts.CONTRACTS.values():
        assert contract.builtins, contract.name
        for name, cand in contract.builtins.items():
            assert cand.contract == contract.name and resolve(name) is cand and builtins()[name] is cand


def test_a_candidate_is_graded_on_its_own_contract_else_the_one_asked_for():
    assert contracts.of(resolve("reference")) is contracts.DENSE
    assert contracts.of(resolve("reference"), "paged") is contracts.PAGED
    assert contracts.of(resolve("paged-reference")) is contracts.PAGED
    assert contracts.of(resolve("paged-reference"), "attention") is contracts.PAGED
    assert contracts.of(resolve("ragged-reference"), "paged") is contracts.RAGGED
    with pytest.raises(ValueError, match="attention, paged, ragged"):
        contracts.get("sparse")


def test_a_features_check_is_named_by_its_contracts_prefix():
    for c in contracts.CONTRACTS.values():
        names = [spec.name for spec in c.checks_for(c.features)]
        assert names[:len(c.checks)] == [spec.name for spec in c.checks]
        assert names[len(c.checks):] == [c.check_prefix + f for f in c.features]


def test_the_flags_select_their_contract_and_reach_both_commands():
    assert contracts.flagged(argparse.Namespace(paged=True)) == "paged"
    assert contracts.flagged(argparse.Namespace(paged=False)) is None
    flags = [c.flag for c in contracts.CONTRACTS.values() if c.flag]
    assert flags == ["--paged", "--ragged"]
    assert contracts.flagged(argparse.Namespace(paged=False, ragged=True)) == "ragged"
    with pytest.raises(ValueError, match="choose one contract"):
        contracts.flagged(argparse.Namespace(paged=True, ragged=True))
    assert all(f in rubric_cli._parser().format_help() for f in flags)


def test_the_records_schema_names_the_registrys_contracts():
    schema = load_schema("correctness")
    assert schema["$defs"]["scorecard"]["properties"]["contract"]["enum"] == list(contracts.CONTRACTS)
    submission = schema["properties"]["submission"]["properties"]["contract"]["enum"]
    assert submission == [n for n in contracts.CONTRACTS if n != contracts.DEFAULT.name]


def test_a_signature_comes_back_as_its_contracts_type():
    dense = Signature.of_call(np.zeros((1, 4, 2, 8), np.float32), np.zeros((1, 6, 1, 8), np.float32),
                              np.zeros((1, 6, 1, 8), np.float32), causal=True)
    paged = PagedSignature.of_call(np.zeros((1, 1, 2, 8), np.float32), np.zeros((3, 4, 1, 8), np.float32),
                                   np.zeros((3, 4, 1, 8), np.float32), kv_lengths=np.array([5], np.int32),
                                   page_indices=np.zeros((1, 2), np.int32))
    for sig in (dense, paged):
        again = contracts.signature_from_dict(sig.to_dict())
        assert type(again) is type(sig) and again == sig
    assert Signature.mismatch({"q": 0, "page_indices": 0}) and Signature.mismatch({"q": 0}) is None
    assert PagedSignature.mismatch({"q": 0}) and PagedSignature.mismatch({"page_indices": 0}) is None
