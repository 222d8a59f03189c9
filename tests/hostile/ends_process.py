"""Candidates that end their process in the middle of a call: exit status 0, exit status 1, abort
(SIGABRT), SIGKILL of itself, and SystemExit(0)."""

import os
import signal
import sys


def exit_zero(q, k, v, **kwargs):
    os._exit(0)


def exit_one(q, k, v, **kwargs):
    os._exit(1)


def abort(q, k, v, **kwargs):
    os.abort()


def kill_self(q, k, v, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)


def system_exit(q, k, v, **kwargs):
    sys.exit(0)
