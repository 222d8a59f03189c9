"""The ragged paged attention contract (``kernel_src.contract.ragged_paged_attention``): its slots, problems, float64
truth, checks and built-in candidates, in modules named as the paged contract's."""
