"""Task functions for tests/test_sweep.py: module-level, so Dask worker processes can import them.

Each writes a file per attempt into the folder named by ``$SWEEP_TEST_DIR``, so a test can count them."""

from __future__ import annotations

import os
import uuid
from pathlib import Path


def _attempt(candidate: str, seed: int) -> int:
    folder = Path(os.environ["SWEEP_TEST_DIR"])
    (folder / f"{candidate}-{seed}-{uuid.uuid4().hex}").touch()
    return len(list(folder.glob(f"{candidate}-{seed}-*")))


def record(candidate: str, seed: int, passed: bool = True) -> dict:
    """A trial record of the shape ``power.trial_record`` gives."""
    return {"candidate": candidate, "kind": "reference", "seed": seed, "passed": passed, "failed": [],
            "error": None, "seconds": 0.0, "groups": {"forward/float32": [0.5, 1.0 + seed, 0.0]},
            "worst_k": 1.0 + seed}


def fake_trial(candidate: str, seed: int, level: str, time_limit_s, isolation: str) -> dict:
    """``ok``: a record; ``dies-once``: kills its worker process on the first attempt; ``broken``: raises."""
    attempt = _attempt(candidate, seed)
    if candidate == "dies-once" and attempt == 1:
        os._exit(1)
    if candidate == "broken":
        raise RuntimeError(f"broken on attempt {attempt}")
    return record(candidate, seed)


def fake_group(tasks, level: str, time_limit_s, isolation: str) -> list[dict]:
    """A calibration slot group (``sweeps.calibration.group_trials``): a record per ``(candidate, seed)``; a
    group holding ``dies-once`` kills its worker process on the group's first attempt, one holding ``broken``
    raises."""
    attempts = [_attempt(name, seed) for name, seed in tasks]
    seeds = sorted({seed for _, seed in tasks})
    (Path(os.environ["SWEEP_TEST_DIR"]) / f"group-{'-'.join(map(str, seeds))}-{uuid.uuid4().hex}").touch()
    names = {name for name, _ in tasks}
    if "dies-once" in names and attempts[0] == 1:
        os._exit(1)
    if "broken" in names:
        raise RuntimeError(f"broken on attempt {attempts[0]}")
    return [dict(record(name, seed), cpu_s=1.0, shared_cpu_s=0.5, slots_from=seed - seed % 5) for name, seed in tasks]
