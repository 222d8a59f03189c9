"""The paged attention contract (``kernel_src.contract.paged_attention``): its slots, problems, float64 truth, checks
and built-in candidates, in modules named as the dense contract's."""
