"""CLI subcommands of the release: build, verify, publish (filled in by the release work)."""

import argparse


def register(subparsers: "argparse._SubParsersAction") -> None:
    """Add the release subcommands to ``tpu-kernel-records``'s parser."""
