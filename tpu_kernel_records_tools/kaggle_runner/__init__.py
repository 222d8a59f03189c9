"""Kaggle TPU runner (``run_kaggle.py``, standalone) and its ``kernel-metadata.json``; see docs/RUNBOOK.md."""
