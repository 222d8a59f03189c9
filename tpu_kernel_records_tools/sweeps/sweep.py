"""Grader sweeps as tasks: one task per (candidate, seed) scorecard, on a Dask cluster or in this process.

A sweep (``tpu-kernel-records power`` or ``calibrate``) is a list of trials, each one candidate graded on
one seed, in its own sandboxed worker process as any scorecard is. :func:`run` grades them

* in this process (``workers=0``), through ``power.measure_power``;
* on a ``LocalCluster`` of ``workers`` single-threaded Dask worker processes (default: one per core);
* on an existing cluster (``scheduler="tcp://host:8786"``: ``dask scheduler`` plus ``dask worker``
  processes on machines that have this project installed).

Every finished trial is appended to a JSON Lines file at once (``out``); ``resume=True`` reads it back
and grades only what is missing, so a killed sweep goes on where it stopped. A task that fails (its Dask
worker lost, an exception in the grader) is tried once more, then reported in ``Sweep.failed``, never
dropped. The trial records do not depend on where they were graded, so the summary and the Markdown
report are the same serially, on a local or on a remote cluster (``seconds_per_trial`` aside).
:func:`map_on_dask` is that machinery for any task (``sweeps.calibration`` sends it a slot group per task).

Work that does not depend on the candidate (each seed's problems, float64 truth and baselines) is kept
by ``grading.dense.checks`` in the process that grades, per seed: each seed's tasks are sent to one Dask worker
(allowed elsewhere only if it is lost), so a seed's truth is computed once, not once per candidate.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from tqdm.auto import tqdm

from ..sweeps import power
from ..grading.candidates import resolve
from ..grading.rubric import grade_seeds

FORMAT = 1
RETRIES = 1  # a failed task is tried this many more times before it is reported


@dataclass
class Sweep:
    """Trial records (``power.trial_record``) in task order, and the tasks that failed twice."""

    trials: list[dict] = field(default_factory=list)
    failed: list[dict] = field(default_factory=list)


def grade_task(candidate: str, seed: int, level: str, time_limit_s: float | None, isolation: str = "auto") -> dict:
    """One trial, where a Dask worker runs it: ``candidate`` graded on ``seed`` in a worker process under
    ``isolation`` (``sandbox.isolation``; a machine that cannot give it fails the task)."""
    cand = resolve(candidate)
    limit = {} if time_limit_s is None else {"time_limit_s": time_limit_s}
    start = time.perf_counter()
    (card,) = grade_seeds(cand, [seed], level=level, isolation=isolation, **limit)
    return power.trial_record(cand, seed, card, time.perf_counter() - start)


def _read(out: Path, settings: dict) -> dict[tuple[str, int], dict]:
    """Finished trials of an earlier run of the same sweep (``settings`` must match its header)."""
    done = {}
    with open(out) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or lines[0].get("sweep") != settings:
        raise ValueError(f"{out} holds another sweep (its first line must be {json.dumps({'sweep': settings})}); "
                         f"choose another --out or drop --resume")
    for line in lines[1:]:
        if "trial" in line:
            record = line["trial"]
            done[(record["candidate"], record["seed"])] = record
    return done


class _Log:
    """The JSON Lines file: a header naming the sweep, then one line per finished or failed trial."""

    def __init__(self, out: Path | None, settings: dict, resume: bool):
        self.path = out
        if out is None:
            return
        if out.exists() and not resume:
            raise FileExistsError(f"{out} exists: pass --resume to go on with it, or choose another --out")
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            self.write({"sweep": settings})

    def write(self, line: dict) -> None:
        if self.path is not None:
            with open(self.path, "a") as f:  # one write per line, flushed before the next task is awaited
                f.write(json.dumps(line) + "\n")
                f.flush()
                os.fsync(f.fileno())


def run(tasks: Sequence[tuple[str, int]], *, level: str, time_limit_s: float | None = None,
        out: Path | None = None, resume: bool = False, workers: int | None = None, scheduler: str | None = None,
        progress: bool = True, sweep: str = "power", isolation: str = "auto",
        task: Callable[..., dict] = grade_task) -> Sweep:
    """Grade every ``(candidate, seed)`` of ``tasks`` (see the module docstring for where).

    ``task(candidate, seed, level, time_limit_s, isolation) -> trial record`` is what each task runs (a
    module-level function, so Dask workers can import it); the default grades a scorecard."""
    settings = {"format": FORMAT, "kind": sweep, "level": level, "tasks": len(tasks)}
    done = _read(out, settings) if (out is not None and resume and out.exists()) else {}
    log = _Log(out, settings, resume)
    todo = [t for t in tasks if t not in done]
    result = Sweep()
    if todo and workers == 0 and scheduler is None:
        _serial(todo, done, (level, time_limit_s, isolation), log, progress, task)
    elif todo:
        result.failed = _on_dask(todo, done, (level, time_limit_s, isolation), log, progress, workers, scheduler,
                                 task)
    result.trials = [done[t] for t in tasks if t in done]
    return result


def _serial(todo, done, how, log, progress, task) -> None:
    level, time_limit_s, isolation = how

    def keep(record: dict) -> None:
        done[(record["candidate"], record["seed"])] = record
        log.write({"trial": record})

    if task is grade_task:  # a worker per candidate and block of seeds, not per trial
        power.grade_trials(todo, level=level, time_limit_s=time_limit_s, progress=progress, on_trial=keep,
                           isolation=isolation)
        return
    for name, seed in tqdm(todo, desc="sweep", unit="grade", disable=not progress):
        keep(task(name, seed, *how))


def client(workers: int | None, scheduler: str | None, memory_limit: str | int = "auto"):
    """A Dask client of ``scheduler``'s cluster, or of a new ``LocalCluster`` of ``workers`` single-threaded
    worker processes (default one per core; ``memory_limit`` per worker, Dask's, 0 for none), and the
    cluster to close (None for a scheduler's)."""
    import dask
    from dask.distributed import Client, LocalCluster

    if scheduler is not None:
        return Client(scheduler), None
    # A task whose worker dies fails at once (Dask would otherwise re-run it up to 3 times); map_on_dask
    # then tries it once more itself, the same rule as for a task that raised.
    dask.config.set({"distributed.scheduler.allowed-failures": 0})
    cluster = LocalCluster(n_workers=workers or os.cpu_count() or 1, threads_per_worker=1, processes=True,
                           dashboard_address=None, memory_limit=memory_limit)
    return Client(cluster), cluster


def map_on_dask(func: Callable, units: Sequence[tuple], *, on_result: Callable[[tuple, object], None],
                on_failure: Callable[[tuple, str], None], workers: int | None = None, scheduler: str | None = None,
                home: Callable[[tuple], object] | None = None, memory_limit: str | int = "auto") -> None:
    """Run ``func(*unit)`` for every unit of ``units`` on Dask (:func:`client`) and pass each result to
    ``on_result(unit, result)`` as it arrives; a unit that fails (its worker lost, an exception) is tried
    ``RETRIES`` more times, then passed to ``on_failure(unit, "Type: message")``. ``home(unit)``: units with
    the same home go to one worker (elsewhere only if it is lost), so what they share is computed once."""
    from dask.distributed import as_completed

    dask_client, cluster = client(workers, scheduler, memory_limit)
    try:
        addresses = sorted(dask_client.scheduler_info()["workers"])
        homes = list(dict.fromkeys(home(u) for u in units)) if home is not None else []
        where = {h: addresses[i % len(addresses)] for i, h in enumerate(homes)}

        def submit(unit):
            placed = {} if home is None else {"workers": [where[home(unit)]], "allow_other_workers": True}
            return dask_client.submit(func, *unit, pure=False, **placed)  # a fresh key per attempt

        futures = {submit(u): (u, 0) for u in units}
        pending = as_completed(list(futures))
        for future in pending:
            unit, tries = futures.pop(future)
            try:
                result = future.result()
            except Exception as error:  # a lost worker, or the task itself failed
                if tries < RETRIES:
                    again = submit(unit)
                    futures[again] = (unit, tries + 1)
                    pending.add(again)
                else:
                    on_failure(unit, f"{type(error).__name__}: {error}")
                continue
            on_result(unit, result)
    finally:
        dask_client.close()
        if cluster is not None:
            cluster.close()


def _on_dask(todo, done, how, log, progress, workers, scheduler, task) -> list[dict]:
    failed = []
    bar = tqdm(total=len(todo) + len(done), initial=len(done), desc="sweep", unit="grade", disable=not progress)

    def keep(unit, record) -> None:
        done[unit[:2]] = record
        log.write({"trial": record})
        bar.update(1)

    def lost(unit, error) -> None:
        line = {"candidate": unit[0], "seed": unit[1], "error": error}
        failed.append(line)
        log.write({"failed": line})
        bar.update(1)

    map_on_dask(task, [(name, seed, *how) for name, seed in todo], on_result=keep, on_failure=lost,
                workers=workers, scheduler=scheduler, home=lambda unit: unit[1])
    bar.close()
    return failed
