"""Contributions: a run proposed to the dataset as a Hub pull request (``submit``), and a maintainer's
review of those pull requests (``review``: scope, the builder's rules, a regrade of exported programs on
seeds drawn now). Imports point down: ``builder``, ``measure``, ``grading``, ``records``."""
