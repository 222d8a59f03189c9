"""The timer stops the clock only after every output is synchronized; stages are timed apart."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernel_records_tools.bench.timing import Timing, block_until_ready, peak_memory_bytes, time_calls, time_jitted


class FakeDevice:
    """A simulated clock and asynchronous results: a call returns at once, the work lands on sync."""

    DISPATCH_S, WORK_S = 0.001, 0.005

    def __init__(self):
        self.now, self.events = 0.0, []

    def clock(self):
        self.events.append("clock")
        return self.now

    def call(self, *args):
        self.events.append("call")
        self.now += self.DISPATCH_S
        return (FakeResult(self, "a"), {"b": FakeResult(self, "b")})


class FakeResult:
    def __init__(self, device, name):
        self.device, self.name, self.done = device, name, False

    def block_until_ready(self):
        if not self.done:
            self.device.now += FakeDevice.WORK_S
            self.done = True
        self.device.events.append(f"block:{self.name}")
        return self


def test_sample_is_taken_after_every_output_is_synchronized():
    dev = FakeDevice()
    samples, _ = time_calls(dev.call, (), warmups=2, samples=3, clock=dev.clock)
    per_sample = ["clock", "call", "block:a", "block:b", "clock"]
    warmup = ["call", "block:a", "block:b"]
    assert dev.events == warmup * 2 + per_sample * 3
    # Dispatch alone would read 1 ms; each sample includes both outputs' work (5 ms each), which
    # the fake only finishes when it is synchronized.
    np.testing.assert_allclose(samples, [11.0, 11.0, 11.0])


def test_an_unsynchronized_timer_would_have_read_only_dispatch():
    dev = FakeDevice()
    samples, _ = time_calls(dev.call, (), warmups=0, samples=2, clock=dev.clock, sync=lambda out: out)
    np.testing.assert_allclose(samples, [1.0, 1.0])  # the fake can tell the difference


def test_time_jitted_fills_every_stage_with_real_jax():
    ticks = iter(range(1000))
    timing = time_jitted(lambda x, y: (x @ y, x.sum()),
                         [jax.ShapeDtypeStruct((8, 8), jnp.float32)] * 2,
                         [np.ones((8, 8), np.float32)] * 2, warmups=1, samples=4,
                         clock=lambda: float(next(ticks)))
    assert timing.lower_ms == timing.compile_ms == timing.transfer_ms == 1000.0
    assert timing.samples_ms == [1000.0] * 4
    assert "stablehlo.dot" in timing.lowered.as_text() or "dot_general" in timing.lowered.as_text()
    np.testing.assert_allclose(np.asarray(timing.output[0]), np.full((8, 8), 8.0))


def test_a_failing_stage_keeps_the_stages_before_it():
    timing = Timing()

    def bad(x):
        raise RuntimeError("trace-time failure")

    with pytest.raises(RuntimeError, match="trace-time"):
        time_jitted(bad, [jax.ShapeDtypeStruct((2,), jnp.float32)], [np.ones(2, np.float32)],
                    warmups=0, samples=1, timing=timing)
    assert timing.lower_ms is None and timing.samples_ms == []


def test_block_until_ready_waits_on_all_leaves():
    dev = FakeDevice()
    block_until_ready(dev.call())
    assert dev.events == ["call", "block:a", "block:b"]


def test_peak_memory_is_null_where_the_backend_reports_none():
    class NoStats:
        def memory_stats(self):
            return None

    class Stats:
        def memory_stats(self):
            return {"peak_bytes_in_use": 10, "bytes_in_use": 3}

    assert peak_memory_bytes([NoStats()]) is None
    assert peak_memory_bytes([Stats(), Stats()]) == 20
