"""The builder's rule on compiled-program facts (``builder.rules``): a published summary carries none
(refused naming rule, file and field), while a measured run may carry them or the reason it has none."""

from __future__ import annotations

import pytest

from tpu_kernel_records_tools.builder import rules
from tpu_kernel_records_tools.records import rawio
from test_rule_refusals import _base


@pytest.mark.parametrize("field, value", [("compiled_tpu_reason", "no matching libtpu"),
                                          ("compiled_tpu", {"kernels": 1})])
def test_a_published_summary_carrying_compiled_facts_is_refused(field, value):
    run = _base("summary")
    run["benchmark"]["cases"][2][field] = value
    with pytest.raises(rawio.RunError) as err:
        rules.accept(run)
    assert (err.value.rule, err.value.file, err.value.field) == ("published-summary", "benchmark.json",
                                                                 "cases/2/compiled_tpu")
    assert "carries no compiled program" in str(err.value)


def test_a_measured_tpu_run_may_say_why_it_has_no_compiled_facts():
    run = _base("tpu")  # every case of a TPU run has a TPU program
    for case in run["benchmark"]["cases"]:
        case["compiled_tpu"], case["compiled_tpu_reason"] = None, "no matching libtpu"
    assert rules.accept(run).interpret is False
