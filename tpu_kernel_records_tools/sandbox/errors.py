"""The two ways a stranger's code fails before it runs: its spec names nothing loadable, or it will not load."""


class CandidateSpecError(ValueError):
    """A ``--candidate`` spec that names no built-in and is not ``file.py:function`` / ``module:function``."""


class CandidateLoadError(RuntimeError):
    """A candidate whose code could not be imported or whose function is missing or not callable."""
