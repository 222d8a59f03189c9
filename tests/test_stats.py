"""Per-case statistics, bootstrap ratios, scaling efficiency and the roofline conventions."""

import numpy as np
import pytest

from tpu_kernel_records_tools.bench import roofline, stats


def test_summary_of_known_samples():
    s = stats.summarize([5.0, 1.0, 4.0, 2.0, 3.0])
    assert s == {"median_ms": 3.0, "min_ms": 1.0, "max_ms": 5.0, "q1_ms": 2.0, "q3_ms": 4.0, "iqr_ms": 2.0}
    even = stats.summarize([1.0, 2.0, 3.0, 10.0])
    assert even["median_ms"] == 2.5 and even["q1_ms"] == 1.75 and even["q3_ms"] == 4.75
    assert stats.summarize([]) == dict.fromkeys(s)


def test_bootstrap_ratio_of_constant_samples_is_exact():
    assert stats.ratio_of_medians([2.0] * 5, [1.0] * 7) == (2.0, 2.0, 2.0)


def test_bootstrap_ci_is_reproducible_and_covers_the_ratio():
    rng = np.random.default_rng(1)
    num, den = 2.0 + 0.2 * rng.standard_normal(20), 1.0 + 0.1 * rng.standard_normal(20)
    first = stats.ratio_of_medians(num, den, seed=0, key="a/b")
    assert first == stats.ratio_of_medians(num, den, seed=0, key="a/b")
    assert first != stats.ratio_of_medians(num, den, seed=1, key="a/b")
    ratio, low, high = first
    assert ratio == pytest.approx(np.median(num) / np.median(den))
    assert low < ratio < high and 1.6 < low and high < 2.4


def test_more_samples_narrow_the_interval():
    rng = np.random.default_rng(2)
    widths = []
    for n in (5, 200):
        _, low, high = stats.ratio_of_medians(1 + 0.1 * rng.standard_normal(n), 1 + 0.1 * rng.standard_normal(n))
        widths.append(high - low)
    assert widths[1] < widths[0] / 2


def test_missing_sides_give_nulls():
    assert stats.ratio_of_medians([], [1.0]) == (None, None, None)
    assert stats.ratio_of_medians([1.0], []) == (None, None, None)


def test_scaling_efficiency():
    assert stats.scaling_efficiency(8.0, 1.0, 8) == 1.0
    assert stats.scaling_efficiency(8.0, 2.0, 8) == 0.5
    assert stats.scaling_efficiency(None, 2.0, 8) is None


def test_visible_pairs_follow_the_contract_masks():
    assert roofline.visible_pairs(4, 4, causal=False, kv_lengths=None, batch=2) == 32
    assert roofline.visible_pairs(4, 4, causal=True, kv_lengths=None, batch=1) == 10
    assert roofline.visible_pairs(4, 4, causal=True, kv_lengths=np.array([2]), batch=1) == 1 + 2 + 2 + 2
    # bottom-right alignment: 2 queries on 4 keys see 3 and 4 keys
    assert roofline.visible_pairs(2, 4, causal=True, kv_lengths=None, batch=1) == 7
    assert roofline.visible_pairs(4, 4, causal=True, kv_lengths=np.array([0]), batch=1) == 0


def test_attention_and_softmax_work():
    flops, nbytes = roofline.attention_work(1, 4, 4, 4, 2, 8, 2, causal=False, kv_lengths=None)
    assert flops == 4 * 4 * 8 * 16
    assert nbytes == (2 * 4 * 4 * 8 + 2 * 4 * 2 * 8) * 2
    flops, nbytes = roofline.softmax_work(2, 4, 8, 8, 2, padded=True)
    assert flops == 5 * 512 and nbytes == 512 * 6 + 8


@pytest.mark.parametrize("kind, peak", [
    ("TPU v5 lite", (197e12, 819e9)), ("TPU v5e", (197e12, 819e9)),
    ("NVIDIA H100 80GB HBM3", (989e12, 3350e9)), ("NVIDIA H100 PCIe", (756e12, 2000e9)),
    ("NVIDIA H200", (989e12, 4800e9)), ("NVIDIA A100-SXM4-80GB", (312e12, 2039e9)),
    ("NVIDIA A100-SXM4-40GB", (312e12, 1555e9)), ("cpu", None), ("TPU v4", None),
])
def test_peak_table(kind, peak):
    assert roofline.device_peak(kind) == (None if peak is None else roofline.Peak(*peak))


def test_rates_and_fractions():
    r = roofline.rates(197e9, 819e6, 1.0, "TPU v5 lite", devices=1)
    assert r["tflops"] == pytest.approx(197.0) and r["gbps"] == pytest.approx(819.0)
    assert r["peak_flops_fraction"] == pytest.approx(1.0) and r["peak_bandwidth_fraction"] == pytest.approx(1.0)
    assert roofline.rates(197e9, 819e6, 1.0, "TPU v5 lite", devices=2)["peak_flops_fraction"] == pytest.approx(0.5)
    unknown = roofline.rates(1e9, 1e9, 1.0, "cpu", devices=1)
    assert unknown["tflops"] == pytest.approx(1.0) and unknown["peak_flops_fraction"] is None
    assert roofline.rates(1e9, 1e9, None, "cpu", devices=1)["tflops"] is None
