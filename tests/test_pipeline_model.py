"""The pipeline-traffic model (``bench.pipeline``) against grids counted by hand.

Each kernel here is only traced (``jax.make_jaxpr``), never run or compiled, so the tests need no
TPU and no libtpu: the model reads the grid and the BlockSpecs' index maps of the traced call.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tpu_kernel_records_tools.bench import pipeline

F32 = jnp.float32
BLOCK = (8, 128)
BLOCK_BYTES = 8 * 128 * 4


def _copy(x_ref, o_ref, *scratch):
    o_ref[...] = x_ref[...]


def _call(grid, in_map, out_map, rows=32):
    """``x -> pallas_call(copy)(x)`` over ``grid`` with (8, 128) fp32 blocks of ``[rows, 128]``."""
    def fn(x):
        return pl.pallas_call(_copy, grid=grid, in_specs=[pl.BlockSpec(BLOCK, in_map)],
                              out_specs=pl.BlockSpec(BLOCK, out_map),
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)
    return fn, [jax.ShapeDtypeStruct((rows, 128), F32)]


def _only(fn, args, known=None):
    records = pipeline.kernel_traffic(fn, args, known)
    assert len(records) == 1
    return records[0]


def test_a_block_that_never_changes_index_is_copied_once():
    kernel = _only(*_call((4, 3), lambda i, j: (0, 0), lambda i, j: (0, 0)))
    assert kernel["steps"] == 12
    assert [e["copies"] for e in kernel["inputs"] + kernel["outputs"]] == [1, 1]
    assert kernel["bytes"] == 2 * BLOCK_BYTES


def test_a_block_revisited_after_another_is_copied_again():
    # inner axis j walks blocks 0, 1, 2 for each i: 0 1 2 0 1 2 0 1 2 0 1 2 -> 12 copies
    inner = _only(*_call((4, 3), lambda i, j: (j, 0), lambda i, j: (i, 0)))
    assert inner["inputs"][0]["copies"] == 12
    # outer axis i: 0 0 0 1 1 1 2 2 2 3 3 3 -> 4 copies, each block once
    outer = _only(*_call((4, 3), lambda i, j: (i, 0), lambda i, j: (i, 0)))
    assert outer["inputs"][0]["copies"] == 4
    assert outer["read_bytes"] == 4 * BLOCK_BYTES == outer["inputs"][0]["array_bytes"]


def test_a_skipped_step_that_repeats_its_block_costs_nothing():
    # steps 2 and 3 are "skipped" and clamp to block 1: 0 1 1 1 -> 2 copies, not 4
    clamped = _only(*_call((4,), lambda i: (jnp.minimum(i, 1), 0), lambda i: (i, 0)))
    assert clamped["inputs"][0]["copies"] == 2
    # the same skip pointing back at block 0 instead costs a copy: 0 1 0 0 -> 3
    back = _only(*_call((4,), lambda i: (jnp.where(i == 1, 1, 0), 0), lambda i: (i, 0)))
    assert back["inputs"][0]["copies"] == 3


def test_output_blocks_are_written_when_their_index_changes():
    # out index i // 2 over grid (8, 2): 0 0 0 0 1 1 1 1 2 2 2 2 3 3 3 3 -> one write per run
    kernel = _only(*_call((8, 2), lambda i, j: (i // 2, 0), lambda i, j: (i // 2, 0)))
    assert kernel["outputs"][0]["copies"] == 4 and kernel["write_bytes"] == 4 * BLOCK_BYTES
    # an output revisited (index alternating with the inner axis) is written at every change
    revisit = _only(*_call((2, 2), lambda i, j: (0, 0), lambda i, j: (j, 0)))
    assert revisit["outputs"][0]["copies"] == 4


def _prefetch_call(table_len=6):
    def kernel(table_ref, x_ref, o_ref):
        o_ref[...] = x_ref[...]

    def fn(table, x):
        spec = pl.BlockSpec(BLOCK, lambda i, table: (table[i], 0))
        return pl.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=(table_len,),
                                                   in_specs=[spec],
                                                   out_specs=pl.BlockSpec(BLOCK, lambda i, t: (i, 0))),
        )(table, x)
    return fn


TABLE = np.array([0, 0, 2, 2, 1, 1], np.int32)  # 3 runs: 0, 2, 1


def test_scalar_prefetch_index_maps_use_the_given_values():
    fn = _prefetch_call()
    args = [jax.ShapeDtypeStruct((6,), jnp.int32), jax.ShapeDtypeStruct((48, 128), F32)]
    kernel = _only(fn, args, known={0: TABLE})
    table, block = kernel["inputs"]  # the table itself is copied to SMEM once
    assert table["copies"] == 1 and table["bytes"] == TABLE.nbytes
    assert block["copies"] == 3 and kernel["outputs"][0]["copies"] == 6


def test_scalar_prefetch_values_are_folded_from_constants_and_unknown_ones_are_reported():
    fn = _prefetch_call()
    folded = _only(lambda x: fn(jnp.asarray(TABLE) * 1, x), [jax.ShapeDtypeStruct((48, 128), F32)])
    assert folded["inputs"][1]["copies"] == 3
    unknown = _only(fn, [jax.ShapeDtypeStruct((6,), jnp.int32), jax.ShapeDtypeStruct((48, 128), F32)])
    assert unknown["bytes"] is None and "scalar-prefetch" in unknown["error"]
    assert pipeline.total_bytes([unknown]) is None


def test_a_small_constant_input_is_read_once():
    """A constant operand (splash's q_sequence iota) stays in VMEM: one read, however often its
    block changes; the same operand as an argument of the program is copied per index change."""
    fn, args = _call((4, 3), lambda i, j: (j, 0), lambda i, j: (i, 0), rows=32)
    table = np.arange(32 * 128, dtype=np.float32).reshape(32, 128)
    constant = _only(lambda: fn(jnp.asarray(table)), [])
    assert constant["inputs"][0]["copies"] == 1 and constant["read_bytes"] == table.nbytes
    assert _only(fn, args)["inputs"][0]["copies"] == 12


def test_only_the_branch_a_tpu_lowering_takes_is_counted():
    tpu, _ = _call((4,), lambda i: (i, 0), lambda i: (i, 0))
    cpu, args = _call((4,), lambda i: (0, 0), lambda i: (i % 2, 0))

    def fn(x):
        return lax.platform_dependent(x, cpu=cpu, tpu=tpu)
    kernel = _only(fn, args)
    assert kernel["inputs"][0]["copies"] == 4 and kernel["outputs"][0]["copies"] == 4


def test_the_rule_on_python_index_maps():
    assert pipeline.copies_of((3, 4), lambda i, j: (i,)) == 3
    assert pipeline.copies_of((3, 4), lambda i, j: (j,)) == 12
    assert pipeline.copies_of((5,), lambda i, n: (min(i, n - 1),), 2) == 2
    assert pipeline.block_copies(np.zeros((0, 2))) == 0


def test_the_projects_causal_forward_counted_by_hand():
    """Flash forward, causal, seq 512 in 128 x 128 tiles, 1 sequence: query block qi needs key
    blocks 0..qi and its skipped steps repeat block qi, so the K (and V) block indices run
    0 0 0 0 | 0 1 1 1 | 0 1 2 2 | 0 1 2 3: 1 + 1 + 3 + 4 = 9 copies (the second query block's
    first block is the one already there); Q read and O written once per query block."""
    from kernel_src import FlashBlockSizes, flash_attention

    seq, hq, hk, d = 512, 4, 2, 128
    tiles = FlashBlockSizes(*(128,) * 6)
    q = jax.ShapeDtypeStruct((1, seq, hq, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, seq, hk, d), jnp.bfloat16)

    def forward(q, k, v, lengths):
        return flash_attention(q, k, v, causal=True, kv_lengths=lengths, block_sizes=tiles)
    kernel = _only(forward, [q, kv, kv, jax.ShapeDtypeStruct((1,), jnp.int32)],
                   known={3: np.array([seq], np.int32)})
    q_block, kv_block = 128 * hq * d * 2, 128 * hk * d * 2
    assert kernel["grid"] == [1, 1, 4, 4]
    assert [e["copies"] for e in kernel["inputs"]] == [1, 4, 9, 9]  # lengths, q, k, v
    assert kernel["outputs"][0]["copies"] == 4  # a forward-only call writes no lse
    assert kernel["bytes"] == 4 + 2 * 4 * q_block + 2 * 9 * kv_block
    # key length 200: query block 0 needs key block 0, the others blocks 0 and 1:
    # 0 0 0 0 | 0 1 1 1 | 0 1 1 1 | 0 1 1 1 -> 1 + 1 + 2 + 2
    short = _only(forward, [q, kv, kv, jax.ShapeDtypeStruct((1,), jnp.int32)],
                  known={3: np.array([200], np.int32)})
    assert [e["copies"] for e in short["inputs"]][1:] == [4, 1 + 1 + 2 + 2, 1 + 1 + 2 + 2]


@pytest.mark.parametrize("mode, kernels", [("fwd", 1), ("fwd+bwd", 3)])
def test_the_vjp_keeps_the_tpu_kernels_of_forward_and_backward(mode, kernels):
    from kernel_src import flash_attention
    from tpu_kernel_records_tools.bench.plan import _program

    q = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)
    args = [q, kv, kv, jax.ShapeDtypeStruct((1,), jnp.int32)] + ([q] if mode == "fwd+bwd" else [])
    records = pipeline.kernel_traffic(_program(flash_attention, True, mode), args,
                                      known={3: np.array([256], np.int32)})
    assert len(records) == kernels and pipeline.total_bytes(records) > 0
