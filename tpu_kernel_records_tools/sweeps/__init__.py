"""Sweeps over the grader: its power on the built-ins, the tolerance calibration, their Dask tasks and trials file."""
