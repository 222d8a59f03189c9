"""Rebinds the grader's judgement (grading.tolerance.judge, Verdict.ok, the checks' summaries) so every
comparison passes, then returns zeros. In a shared process this once scored 78/100 and made the next
candidate pass; in a worker it changes only the worker's copies."""

import jax.numpy as jnp


def _rebind():
    from tpu_kernel_records_tools.grading.dense import checks

    from tpu_kernel_records_tools.grading import tolerance
    real_judge = tolerance.judge

    def judge(*args, **kwargs):
        verdict = real_judge(*args, **kwargs)
        return verdict

    tolerance.judge = judge
    checks.judge = judge
    try:
        tolerance.Verdict.ok = property(lambda self: True)
    except (AttributeError, TypeError):
        pass
    for name in dir(checks):
        if name.startswith("check_"):
            setattr(checks, name, lambda ctx: checks.Outcome(True, "rebound"))


def attention(q, k, v, *, causal=False, kv_lengths=None, scale=None):
    _rebind()
    return jnp.zeros(q.shape, q.dtype)
