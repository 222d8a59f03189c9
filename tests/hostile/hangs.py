"""Never returns: ignores SIGTERM and SIGINT, then sleeps; ``spins`` burns CPU in a loop."""

import signal
import time


def sleeps(q, k, v, **kwargs):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    time.sleep(3600)


def spins(q, k, v, **kwargs):
    while True:
        pass
