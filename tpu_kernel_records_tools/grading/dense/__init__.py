"""The dense attention contract (``kernel_src.contract.attention``): its slots, problems, float64 truth, checks and
built-in candidates, plus its features' checks and the pure-JAX attention the built-ins are made of."""
