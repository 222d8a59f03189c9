"""Where ``flash_attention`` used to live; the kernels are now the package ``kernel_src.flash``."""

from kernel_src.flash import FlashBlockSizes, flash_attention

__all__ = ["FlashBlockSizes", "flash_attention"]
