"""Attention kernels under test and the pure-JAX oracle they are checked against.

Every public kernel follows the candidate contract in ``kernel_src.contract``.
"""

from kernel_src.contract import check_inputs, default_scale
from kernel_src.reference import (reference_attention, reference_masked_softmax, reference_paged_attention,
                                  reference_ragged_paged_attention)
from kernel_src.masked_softmax import SoftmaxBlockSizes, masked_softmax
from kernel_src.attention import pallas_attention
from kernel_src.flash_attention import FlashBlockSizes, flash_attention  # the module name stays importable
from kernel_src.sharded import sharded_attention

__all__ = ["check_inputs", "default_scale", "reference_attention", "reference_masked_softmax",
           "reference_paged_attention", "reference_ragged_paged_attention", "SoftmaxBlockSizes", "masked_softmax", "pallas_attention",
           "FlashBlockSizes", "flash_attention", "sharded_attention"]
