"""The Mosaic kernels' head layouts agree bit for bit, in interpret mode on this CPU.

Compiled for TPU under jax < 0.7 the kernels cannot index a head of a ``[b, s, heads, d]`` block,
so they read the free view ``[b, s * heads, d]`` ("rows": heads as strided rows, 16-bit data
through 32-bit words) or the flat view ("flat"). Those paths run on a TPU only under that jax;
here ``flash_attention(layout=...)`` runs them in interpret mode, where they must give exactly
what the in-place layout ("heads", which the rubric grades) gives: forward-only calls, and the
forward with log-sum-exp plus all three gradient kernels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_src.backend import tpu_interpret_races_found
from kernel_src.flash import FlashBlockSizes, flash_attention, plan as flash_plan

BLOCKS = FlashBlockSizes(128, 128, 128, 128, 128, 128)


def _features(q_heads, q_len, kv_len) -> dict:
    """Every feature of the contract: a 20-key window (query block 1 needs key block 1 only), a
    cap, packed segment ids (the queries are the last keys) and a sink per query head."""
    rng = np.random.default_rng(4)
    kv_ids = np.sort(rng.integers(0, 5, (2, kv_len)), axis=1).astype(np.int32)
    return dict(window_size=(20, 0), softcap=20.0, q_segment_ids=jnp.asarray(kv_ids[:, kv_len - q_len:]),
                kv_segment_ids=jnp.asarray(kv_ids),
                sinks=jnp.asarray(rng.standard_normal(q_heads).astype(np.float32)))


def _outputs(layout, dtype, q_heads, kv_heads, head_dim=128, q_len=136, kv_len=200,
             interpret=True, features=False):
    """Forward-only output, then (output, dq, dk, dv) of one VJP; causal, ragged kv_lengths,
    sequences padded to two blocks each; ``features``: with every feature (``_features``)."""
    rng = np.random.default_rng(3)
    shapes = [(2, q_len, q_heads, head_dim), (2, kv_len, kv_heads, head_dim),
              (2, kv_len, kv_heads, head_dim), (2, q_len, q_heads, head_dim)]
    q, k, v, do = (jnp.asarray(rng.standard_normal(s, np.float32)).astype(dtype) for s in shapes)
    lengths = jnp.asarray([kv_len, 77], jnp.int32)
    extra = _features(q_heads, q_len, kv_len) if features else {}

    @jax.jit
    def run(q, k, v, do):
        def attend(q, k, v):
            return flash_attention(q, k, v, causal=True, kv_lengths=lengths, block_sizes=BLOCKS,
                                   interpret=interpret, layout=layout, **extra)
        out, vjp = jax.vjp(attend, q, k, v)
        return (attend(q, k, v), out, *vjp(do))
    return [np.asarray(x.astype(jnp.float32)) for x in run(q, k, v, do)]


@pytest.mark.parametrize("layout, dtype, q_heads, kv_heads", [
    pytest.param("rows", jnp.bfloat16, 4, 2, marks=pytest.mark.slow),  # head pairs share 32-bit words
    pytest.param("rows", jnp.bfloat16, 8, 1, marks=pytest.mark.slow),  # one kv head: its block is the head
    pytest.param("rows", jnp.float32, 4, 2, marks=pytest.mark.slow),  # strided 32-bit rows, no words
    pytest.param("flat", jnp.bfloat16, 4, 2, marks=pytest.mark.slow),  # lane windows
])
def test_a_layout_gives_exactly_what_the_in_place_layout_gives(layout, dtype, q_heads, kv_heads):
    expected = _outputs("heads", dtype, q_heads, kv_heads)
    got = _outputs(layout, dtype, q_heads, kv_heads)
    names = ("forward-only out", "out", "dq", "dk", "dv")
    for name, want, have in zip(names, expected, got):
        assert np.abs(want).max() > 0, name  # something was computed
        np.testing.assert_array_equal(have, want, err_msg=f"{layout} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["rows", "flat"])
def test_every_feature_gives_in_a_layout_exactly_what_the_in_place_layout_gives(layout):
    """The features' logic is the layouts' common part (the plan's masks, ranges and statistics;
    ids and sinks are inputs of their own), so the layouts jax < 0.7 compiles agree bit for bit
    with every feature on too: bf16 head pairs in 32-bit words ("rows"), lane windows ("flat")."""
    expected = _outputs("heads", jnp.bfloat16, 4, 2, features=True)
    got = _outputs(layout, jnp.bfloat16, 4, 2, features=True)
    names = ("forward-only out", "out", "dq", "dk", "dv")
    for name, want, have in zip(names, expected, got):
        assert np.abs(want).max() > 0, name
        np.testing.assert_array_equal(have, want, err_msg=f"{layout} {name}")
    plain = _outputs("heads", jnp.bfloat16, 4, 2)
    assert not np.array_equal(plain[0], expected[0])  # the features changed the output


@pytest.mark.slow  # 10 s alone; the layouts' bit-for-bit tests stay in the default run
def test_the_rows_layout_reads_no_word_before_it_is_written(tpu_interpret):
    """TPU interpret mode fills scratch and outputs with NaN: a 32-bit copy read before it is
    made, or an output block left unwritten, would show; and no races."""
    expected = _outputs("heads", jnp.bfloat16, 4, 2)
    got = _outputs("rows", jnp.bfloat16, 4, 2, interpret=tpu_interpret)
    for want, have in zip(expected, got):
        np.testing.assert_array_equal(have, want)
    assert tpu_interpret_races_found() is not True


def test_the_rows_view_is_taken_only_where_it_is_free():
    """Byte-identical tilings (the v5e compiler's bitcast): 128-lane heads, 1, 2, 4 or 8k heads."""
    free = {h: flash_plan.rows_view_is_free(h, 128) for h in (1, 2, 3, 4, 6, 8, 12, 16, 32)}
    assert free == {1: True, 2: True, 3: False, 4: True, 6: False, 8: True, 12: False, 16: True,
                    32: True}
    assert not flash_plan.rows_view_is_free(4, 64)
    expected = "heads" if flash_plan.HEADS_IN_PLACE else "rows"
    assert flash_plan.mosaic_layout(4, 2, 128) == expected
    assert flash_plan.mosaic_layout(32, 8, 128) == expected
    assert flash_plan.mosaic_layout(6, 2, 128) == ("heads" if flash_plan.HEADS_IN_PLACE else "flat")
    assert flash_plan.mosaic_layout(4, 2, 64) == ("heads" if flash_plan.HEADS_IN_PLACE else "flat")


def test_the_rows_layout_holds_every_head_per_step_and_counts_its_words():
    blocks, heads = flash_plan.tpu_tiles(2048, 2048, 32, 8, 128, 2, layout="rows")
    assert heads == 8  # its block rows interleave all heads
    q_tile, kv_tile = 512 * 4 * 128 * 2, 512 * 2 * 128 * 2  # bf16, 4 / 2 heads, no padding
    for phase, q_side in (("fwd", 1), ("dq", 2), ("dkv", 2)):
        words = (flash_plan.vmem_estimate(phase, 512, 512, 2, 2, 128, 2, layout="rows")
                 - flash_plan.vmem_estimate(phase, 512, 512, 2, 2, 128, 2, layout="flat"))
        assert words == q_side * q_tile + 2 * kv_tile, phase  # the 32-bit copies of the inputs
    assert (flash_plan.vmem_estimate("fwd", 512, 512, 2, 2, 128, 2, layout="heads")
            > flash_plan.vmem_estimate("fwd", 512, 512, 2, 2, 128, 2, layout="flat"))  # padding


@pytest.mark.parametrize("layout, message", [("rows", "layout 'rows' needs"),
                                             ("diagonal", "layout must be one of")])
def test_a_layout_that_cannot_hold_is_refused_in_one_line(layout, message):
    q = jnp.zeros((1, 128, 3, 128), jnp.float32)
    k = jnp.zeros((1, 128, 1, 128), jnp.float32)
    with pytest.raises(ValueError, match=message):
        flash_attention(q, k, k, layout=layout, interpret=True)
