"""sweeps.calibration: the trial grades the full grade's numeric problems and gets its needed k; the sweep
streams, resumes without grading anything twice, survives a cut-off last line, stops on its budget; the
report counts seeds, states the rule and names every false reject.

The default run fakes the trials (``seed_trials`` replaced) or draws a quick-level seed's problems; the slow
run compares a full-level seed's draws with the rubric's own, and grades the reference for real,
in-process and in its worker, at the quick level.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tpu_kernel_records_tools.cli.main import main
from tpu_kernel_records_tools.sweeps import calibration as cal
from tpu_kernel_records_tools.sweeps import calibration_report as cal_report
from tpu_kernel_records_tools.grading.dense import checks as C
from tpu_kernel_records_tools.sweeps import trials_file


def _record(name: str, seed: int, *, forward: float = 1.5, gradient: float = 2.0, passed: bool = True) -> dict:
    return {"candidate": name, "kind": "correct-variant", "seed": seed, "passed": passed,
            "failed": [] if passed else ["forward-accuracy"], "error": None, "isolation": "in-process",
            "seconds": 1.0, "groups": {"forward/float32": [0.3, forward, 0.0], "gradient/bfloat16": [0.4, gradient, 0.0]},
            "worst_k": max(forward, gradient), "trial": "numeric", "cpu_s": 2.0, "shared_cpu_s": 1.0}


@pytest.fixture
def graded(monkeypatch):
    """``seed_trials`` replaced by a fake that records every (candidate, seed) it grades."""
    calls: list[tuple[str, int]] = []

    def fake(seed, names, *, level, slots_from, runners, on_trial, stop):
        for name in names:
            if stop():
                break
            calls.append((name, seed))
            on_trial({**_record(name, seed), "slots_from": slots_from})
    monkeypatch.setattr(cal, "seed_trials", fake)
    monkeypatch.setattr(cal, "distribution_digest", lambda level="full": "today")
    return calls


class Clock:
    """A clock that moves by ``step`` seconds each time it is read."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _trials(path: Path) -> list[tuple[str, int]]:
    return [(line["trial"]["candidate"], line["trial"]["seed"]) for line in trials_file.read(path).lines]


def test_a_run_stops_on_its_budget_and_resume_grades_nothing_twice(tmp_path, graded):
    out = tmp_path / "trials.jsonl"
    tasks = cal.calibration_tasks(3, ["a", "b"])
    first = cal.run(tasks, out=out, budget_s=4.5, clock=Clock(1.0), progress=False)
    assert 0 < first.graded < len(tasks) and first.remaining == len(tasks) - first.graded
    assert _trials(out) == tasks[:first.graded]
    with pytest.raises(FileExistsError, match="--resume"):
        cal.run(tasks, out=out, progress=False)
    rest = cal.run(tasks, out=out, resume=True, progress=False)
    assert rest.remaining == 0 and rest.graded == len(tasks) - first.graded
    assert sorted(graded) == sorted(tasks) and len(graded) == len(set(graded))  # each graded once
    assert _trials(out) == tasks and [(r["candidate"], r["seed"]) for r in rest.trials] == tasks
    again = cal.run(tasks, out=out, resume=True, progress=False)
    assert again.graded == 0 and len(graded) == len(tasks)


def test_a_cut_off_last_line_is_dropped_reported_and_graded_again(tmp_path, graded):
    out = tmp_path / "trials.jsonl"
    tasks = cal.calibration_tasks(1, ["a", "b"])
    cal.run(tasks[:3], out=out, progress=False)
    whole = out.read_bytes()
    out.write_bytes(whole[:-25])  # the third trial's line, cut off mid-write
    found = trials_file.read(out)
    assert found.cut_off is not None and len(found.lines) == 2
    trials, notes = cal.read_trials(out)
    assert len(trials) == 2 and "cut off" in notes[0]
    graded.clear()
    result = cal.run(tasks, out=out, resume=True, progress=False)
    assert graded == tasks[2:] and any("cut off" in n for n in result.notes)
    assert _trials(out) == tasks and trials_file.read(out).cut_off is None  # appended on a line of its own
    out.write_bytes(whole.replace(b'"seed": 0', b'"seed": 0,,', 1))  # damage before the last line: refused
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        cal.run(tasks, out=out, resume=True, progress=False)


def test_another_sweeps_file_is_refused(tmp_path, graded):
    out = tmp_path / "trials.jsonl"
    out.write_text(json.dumps({"sweep": {"format": 1, "kind": "power", "level": "full", "tasks": 4}}) + "\n")
    with pytest.raises(ValueError, match="another sweep"):
        cal.run([("a", 0)], out=out, resume=True, progress=False)
    assert graded == []


def test_trials_drawn_from_another_distribution_are_not_added_to(tmp_path, graded, monkeypatch):
    out = tmp_path / "trials.jsonl"
    cal.run([("a", 0)], out=out, progress=False)
    assert trials_file.read(out).header["sweep"]["problems"] == "today"
    monkeypatch.setattr(cal, "distribution_digest", lambda level="full": "after a check changed")
    with pytest.raises(ValueError, match="another sweep"):
        cal.run([("a", 0), ("a", 1000)], out=out, resume=True, progress=False)
    assert graded == [("a", 0)]
    assert [t["seed"] for t in cal.read_trials(out)[0]] == [0]  # the report still reads them


def test_the_distribution_digest_follows_every_input_of_every_drawn_problem(monkeypatch):
    """Stable from one call to the next; another value law (one input of one problem changed by one) or
    another shape changes it; and the seed's problems are not kept afterwards."""
    import threading

    queued, here = [], threading.current_thread()  # another test's planning thread may still be running
    monkeypatch.setattr(C, "compute_ahead", lambda found: queued.append(found) if threading.current_thread() is here else None)
    monkeypatch.setattr(C, "_CACHE", {})
    forgotten, forget = [], cal._forget
    monkeypatch.setattr(cal, "_forget", lambda seed, level: (forgotten.append((seed, level)), forget(seed, level)))
    today = cal.distribution_digest("quick")
    assert queued == []  # a trial's truths are computed one at a time, never on the background threads
    assert today == cal.distribution_digest("quick") and len(today) == 64
    assert forgotten == [(0, "quick")] * 2
    real = cal.seed_problems

    def changed(how):
        def draw(*args, **kwargs):
            found = real(*args, **kwargs)
            found[-1] = how(found[-1])
            return found
        return draw

    def one_value(p):
        v = p.host("v")
        v.flat[-1] += 1.0
        return p.replace(p.label, v=v)

    monkeypatch.setattr(cal, "seed_problems", changed(one_value))
    assert cal.distribution_digest("quick") != today
    shorter = lambda p: p.replace(p.label, q=p.host("q")[:, :-1], ct=None if p.ct is None else p.host("ct")[:, :-1])  # noqa: E731
    monkeypatch.setattr(cal, "seed_problems", changed(shorter))
    assert cal.distribution_digest("quick") != today


def test_the_report_counts_seeds_and_states_the_rule_and_each_false_reject():
    trials = [_record("a", 0, forward=2.0), _record("b", 0), _record("a", 1, gradient=4.1), _record("b", 1),
              _record("a", 1000, forward=3.0), {**_record("a", 1001, passed=False), "slots_from": 1000}]
    table = cal_report.report(trials, notes=["5 of 8 trials not graded yet"])
    assert "2 calibration seeds (0-1; 2 slot draws)" in table and "2 held-out seeds (1000-1001; 1 slot draw)" in table
    assert "| a | 2 | 2.00 / 4.10 | 2 | 3.00 / 2.00 | 0 + 1 |" in table
    assert "| b | 2 | 1.50 / 2.00 | 0 | - | 0 + - |" in table
    assert "forward 3, gradient 6 (policy: 5, 6)" in table  # ceil(1.25 x 2.0), ceil(1.25 x 4.1)
    assert "within the policy" in table and "held-out false rejects: 1" in table
    assert "False rejects (1): a seed 1001 (held-out): forward-accuracy" in table
    assert "Note: 5 of 8 trials not graded yet" in table and "3.0 CPU-s per trial" in table
    assert ("3.0 per trial of a pure-JAX candidate (3.0 on a slot group's first seed, which compiles; 3.0 on the "
            "other seeds), of which 1.0 is its share") in table
    compiled, reused = {**_record("a", 0), "cpu_s": 5.0, "slots_from": 0}, {**_record("a", 1), "slots_from": 0}
    split = cal_report.summary([compiled, reused])
    assert (split["first_seed_cpu_s_per_trial"], split["other_seeds_cpu_s_per_trial"]) == (6.0, 3.0)
    assert "(6.0 on a slot group's first seed, which compiles; 3.0 on the other seeds)" in cal_report.report([compiled, reused])
    assert "on a slot group's first seed" not in cal_report.report([compiled])  # no other seed yet: no split stated
    assert "per candidate: a 2.0, b 2.0." in table
    assert "OVER the policy" in cal_report.report([_record("a", 1000, gradient=6.5)])
    near = {**_record("a", 1000), "groups": {"gradient/float32": [0.97, 5.35, 3.84], "forward/float32": [0.1, 1, 0.5]}}
    assert cal_report.summary([near, _record("a", 0)])["floor_needed"] == {"calibration": 0.0, "held-out": 3.84}
    assert "calibration 0.00, held-out 3.84 (policy: FLOOR_EPS 4;" in cal_report.report([near, _record("a", 0)])
    assert "No held-out seed graded yet." in cal_report.report([_record("a", 0)]) and \
        "Held-out largest" not in cal_report.report([_record("a", 0)])


def test_the_reports_cost_per_trial_leaves_the_interpret_mode_kernels_apart():
    kernel = dict(_record("flash", 0), cpu_s=500.0, shared_cpu_s=1.0)
    table = cal_report.report([_record("a", 0), _record("b", 0), kernel])
    assert "3.0 CPU-s per trial (candidate and seed) of the pure-JAX candidates" in table
    assert "per candidate: a 2.0, b 2.0. The kernels' own, in interpret mode: flash 500.0." in table
    assert "kernels' own" not in cal_report.report([_record("a", 0)])
    here = [dict(_record(n, s), machine="this machine") for n in ("a", "b") for s in (0, 1)]
    there = [dict(kernel, seed=seed, machine="the kernels' machine") for seed in (0, 1)]
    there.append(dict(kernel, seed=2, cpu_s=300.0, machine="this machine"))
    s = cal_report.summary([*here, *there])
    assert s["cost_machine"] == "this machine" and s["kernel_cost_machine"] == "the kernels' machine"
    assert s["own_cpu_s_per_trial"] == {"a": 2.0, "b": 2.0} and s["kernel_own_cpu_s_per_trial"] == {"flash": 500.0}
    assert ("The kernels' own, in interpret mode: flash 500.0 (graded on the kernels' machine)."
            in cal_report.report([*here, *there]))


def test_the_report_prices_all_its_pure_jax_trials_in_cpu_hours():
    """The CPU-hours are every pure-JAX trial of the report at its per-trial rate; the kernels are left out."""
    trials = [dict(_record(n, seed), cpu_s=1700.0, shared_cpu_s=100.0) for n in ("a", "b") for seed in (0, 1, 1000)]
    trials.append(dict(_record("flash", 0), cpu_s=36000.0))
    s = cal_report.summary(trials)
    assert s["pure_trials"] == {"trials": 6, "candidates": 2, "cpu_hours": 3.0}
    assert "At that rate this report's 6 trials of the 2 pure-JAX candidates cost 3.0 CPU-hours." in \
        cal_report.report(trials)


def test_the_cost_is_one_machines_the_one_that_graded_the_most():
    here = [dict(_record(n, 0), machine="this machine") for n in ("a", "b")]
    there = dict(_record("a", 1), machine="a faster one", cpu_s=0.5, shared_cpu_s=0.1)
    s = cal_report.summary([*here, there])
    assert s["cost_machine"] == "this machine" and s["cost_trials"] == 2 and s["cpu_s_per_trial"] == 3.0
    assert s["other_machines"] == {"a faster one": {"trials": 1, "cpu_s_per_trial": 0.6}}
    table = cal_report.report([*here, there])
    assert "measured on this machine (2 trials;" in table and "the 1 trials graded on other machines are priced apart" in table
    assert "On other machines: a faster one: 0.6 per trial of a pure-JAX candidate (1 trials)." in table
    alone = cal_report.report(here)
    assert "priced apart" not in alone and "other machines" not in alone
    assert cal_report.summary(here)["other_machines"] == {}


def test_a_groups_seeds_take_its_first_seeds_slots_and_their_own_values():
    """Every slot draw (shapes, feature and paged slots) goes through ``slot_seed``, every value draw through
    the seed, and the problems of a seed with borrowed slots are kept apart from its own."""
    from tpu_kernel_records_tools.grading.dense.feature_checks import feature_slots
    from tpu_kernel_records_tools.grading.paged.checks import slots as paged_slots
    from kernel_src.contract import FEATURES

    lead, member, own = C.Context(None, 0), C.Context(None, 3, slots_from=0), C.Context(None, 3)
    assert member.slot_seed == 0 and own.slot_seed == 3
    assert member.shapes == lead.shapes != own.shapes
    for feature in FEATURES:
        assert repr(feature_slots(member, feature)) == repr(feature_slots(lead, feature))
    assert any(repr(feature_slots(own, f)) != repr(feature_slots(lead, f)) for f in FEATURES)
    assert repr(paged_slots(member)) == repr(paged_slots(lead)) != repr(paged_slots(own))
    assert np.array_equal(member.rng("check", 1).random(4), own.rng("check", 1).random(4))
    assert not np.array_equal(member.rng("check", 1).random(4), lead.rng("check", 1).random(4))
    assert C.cache_key(own, "c") == C.cache_key(C.Context(None, 3, slots_from=3), "c") == (3, "full", "c")
    assert C.cache_key(member, "c") == (3, "full", "c", 0)


def test_the_kernels_get_their_first_seeds_of_each_set():
    tasks = cal.calibration_tasks(3, ["reference", "flash"], kernel_seeds=1)
    assert tasks == [("reference", 0), ("flash", 0), ("reference", 1), ("reference", 2), ("reference", 1000),
                     ("flash", 1000), ("reference", 1001), ("reference", 1002)]


def test_the_seeds_run_a_slot_group_of_each_set_in_turn():
    g = cal.SLOT_GROUP
    assert cal.HELD_OUT_FIRST_SEED % g == 0 and g > 1
    seeds = cal.calibration_seeds(g + 2)
    assert seeds == [*range(g), *range(1000, 1000 + g), g, g + 1, 1000 + g, 1001 + g]
    assert [cal.slots_seed(s) for s in seeds] == [0] * g + [1000] * g + [g] * 2 + [1000 + g] * 2
    with pytest.raises(ValueError, match="seeds must be >= 1"):
        cal.calibration_seeds(0)


def test_a_run_gives_each_seed_its_groups_slots_and_lets_the_programs_go_between_groups(tmp_path, graded,
                                                                                        monkeypatch):
    released = []
    monkeypatch.setattr(cal, "release_compiled", lambda runners, limit=None, *, now=False: released.append(
        (len(graded), now)))
    tasks = cal.calibration_tasks(cal.SLOT_GROUP + 1, ["a"])
    result = cal.run(tasks, out=tmp_path / "trials.jsonl", progress=False)
    assert [r["slots_from"] for r in result.trials] == [cal.slots_seed(s) for _, s in tasks]
    g = cal.SLOT_GROUP  # groups: 0..g-1, 1000.., g, 1000 + g: released before each group but the first
    assert released == [(g, True), (2 * g, True), (2 * g + 1, True)]
    assert trials_file.read(tmp_path / "trials.jsonl").header["sweep"]["slot_group"] == g


def test_report_only_regenerates_the_table_from_the_file_without_grading(tmp_path, graded, capsys):
    out, md = tmp_path / "trials.jsonl", tmp_path / "report.md"
    cal.run(cal.calibration_tasks(2, ["a"]), out=out, progress=False)
    graded.clear()
    status = main(["calibrate", "--report-only", "--trials", str(out), "--markdown", str(md)])
    assert status == 0 and graded == []
    assert "2 calibration seeds (0-1; 1 slot draw) and 2 held-out seeds (1000-1001; 1 slot draw), 4 trials" in md.read_text()
    assert main(["calibrate", "--report-only", "--trials", str(tmp_path / "none.jsonl"),
                 "--markdown", str(md)]) == 2


@pytest.mark.slow  # it draws a full-level seed twice (11 s of the default run on 2 busy cores)
def test_the_trial_draws_exactly_the_full_levels_numeric_problems(monkeypatch):
    """What a full grade's checks send to the candidate on a seed (the rubric's own planning, ``plan_ahead``,
    on a fresh cache) and what the calibration trial draws: the same problems, in the same order, bit for bit
    (the truth is not computed here: the background threads are switched off)."""
    monkeypatch.setattr(C, "compute_ahead", lambda found: None)
    seed = 3

    monkeypatch.setattr(C, "_CACHE", {})
    C.plan_ahead(seed, "full", cal.numeric_checks(("window",))).join()
    planned = C._CACHE
    monkeypatch.setattr(C, "_CACHE", {})
    ours = cal.seed_problems(seed, "full", ("window",), prepare=False)
    assert all(p is not q for p in ours for q in planned.values())
    theirs = []
    for spec in cal.numeric_checks(("window",)):
        stack = [planned[(seed, "full", spec.name)]]
        while stack:
            x = stack.pop(0)
            if isinstance(x, (list, tuple)):
                stack[:0] = list(x)
            elif hasattr(x, "derived") and not x.derived:
                theirs.append(x)
    assert len(ours) == len(theirs) > 60
    assert {p.slot for p in ours} >= {"longcache", "serve8", "prefill", "exact4096"}  # today's full level
    for a, b in zip(ours, theirs):
        assert (a.label, a.dtype, a.key, a.window, a.softcap) == (b.label, b.dtype, b.key, b.window, b.softcap)
        for name in ("q", "k", "v", "ct"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or np.array_equal(np.asarray(x), np.asarray(y))
        assert np.array_equal(a.lengths, b.lengths) if a.lengths is not None else b.lengths is None
        assert np.array_equal(a.sinks, b.sinks) if a.sinks is not None else b.sinks is None
    member = cal.seed_problems(seed + 1, "full", ("window",), prepare=False, slots_from=seed)
    assert len(member) == len(ours)
    for a, b in zip(member, ours):  # the group's slots, the member's own values
        assert (a.dtype, a.key, a.window, a.softcap, a.causal, a.scale) == (b.dtype, b.key, b.window, b.softcap,
                                                                           b.causal, b.scale)
        assert a.q.shape == b.q.shape and not np.array_equal(np.asarray(a.q), np.asarray(b.q))
    assert "determinism" not in {s.name for s in cal.numeric_checks()} and \
        "output-shape-dtype" not in {s.name for s in cal.numeric_checks()}


def test_a_strangers_candidate_is_never_run_in_process():
    from tpu_kernel_records_tools.grading.candidates import resolve

    with pytest.raises(ValueError, match="sandboxed worker"):
        cal.InProcessRunner(resolve("tests/hostile/does_not_matter.py:attention"))


@pytest.mark.slow
def test_the_trials_needed_k_is_the_full_scorecards():
    """The reference on one seed (quick level: the same code path, a minute less): the calibration trial
    (numeric checks, in-process) and the rubric's full scorecard (every check, in its worker process) give
    the same needed k and error/tolerance ratio in every group, and both pass."""
    from tpu_kernel_records_tools.sweeps import power
    from tpu_kernel_records_tools.grading.candidates import resolve
    from tpu_kernel_records_tools.grading.rubric import grade_seeds

    (trial,) = cal.seed_trials(5, ["reference"], level="quick")
    assert not any(key[:2] == (5, "quick") for key in C._CACHE)  # a finished seed's problems are let go
    (card,) = grade_seeds("reference", [5], level="quick")
    full = power.trial_record(resolve("reference"), 5, card, 0.0)
    assert trial["passed"] and full["passed"] and trial["trial"] == "numeric"
    assert trial["groups"] == full["groups"] and trial["worst_k"] == full["worst_k"]
    assert trial["cpu_s"] > 0 and trial["shared_cpu_s"] > 0


def test_shards_share_the_slot_groups_and_each_holds_both_sets():
    seeds = 3 * cal.SLOT_GROUP
    every = cal.calibration_tasks(seeds, ["a", "flash"], kernel_seeds=1)
    parts = [cal.calibration_tasks(seeds, ["a", "flash"], kernel_seeds=1, shard=(k, 2)) for k in range(2)]
    assert sorted(parts[0] + parts[1]) == sorted(every) and not set(parts[0]) & set(parts[1])
    for part in parts:
        assert {s >= cal.HELD_OUT_FIRST_SEED for _, s in part} == {False, True}
    assert not {cal.slots_seed(s) for _, s in parts[0]} & {cal.slots_seed(s) for _, s in parts[1]}
    with pytest.raises(ValueError, match="shard"):
        cal.calibration_tasks(4, ["a"], shard=(2, 2))


def test_merged_shards_hold_every_trial_once_and_resume_grades_nothing(tmp_path, graded, capsys):
    seeds = cal.SLOT_GROUP + 1
    tasks = cal.calibration_tasks(seeds, ["a", "b"])
    one, two, out = tmp_path / "one.jsonl", tmp_path / "two.jsonl", tmp_path / "trials.jsonl"
    cal.run(cal.calibration_tasks(seeds, ["a", "b"], shard=(0, 2)), out=one, progress=False)
    cal.run(cal.calibration_tasks(seeds, ["a", "b"], shard=(1, 2)), out=two, progress=False)
    assert _trials(two)
    assert main(["calibrate", "--seeds", str(seeds), "--trials", str(out), "--markdown", str(tmp_path / "r.md"),
                 "--merge", str(one), str(two)]) == 0
    assert sorted(_trials(out)) == sorted(tasks)
    assert cal.merge(out, [one, two]) == (0, [])  # nothing twice
    graded.clear()
    assert cal.run(tasks, out=out, resume=True, progress=False).graded == 0 and graded == []
    assert f"{seeds} calibration seeds (0-{seeds - 1}; 2 slot draws) and {seeds} held-out seeds" in \
        (tmp_path / "r.md").read_text()
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"sweep": {**trials_file.read(one).header["sweep"], "problems": "yesterday"}}) + "\n")
    with pytest.raises(ValueError, match="another sweep"):
        cal.merge(out, [other])
    assert main(["calibrate", "--trials", str(out), "--merge", str(other)]) == 2
    assert "another sweep" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["calibrate", "--shard", "2/2"])


def test_a_run_and_a_merge_write_the_report_that_report_only_writes(tmp_path, graded, capsys, monkeypatch):
    """The report is a function of the trials file: a run (tasks in its own order, its budget out) and a
    merge (a source's cut-off last line) write what ``--report-only`` writes, and say the rest on stderr."""
    seeds, names = cal.SLOT_GROUP + 1, ["reference", "online-softmax"]
    out, two, md, only = (tmp_path / n for n in ("trials.jsonl", "two.jsonl", "run.md", "only.md"))
    machines = iter(["m1", "m2"] * 100)
    fake = cal.seed_trials

    def on_two_machines(seed, names, *, on_trial, **kw):
        return fake(seed, names, on_trial=lambda r: on_trial({**r, "machine": next(machines)}), **kw)
    monkeypatch.setattr(cal, "seed_trials", on_two_machines)
    cal.run(cal.calibration_tasks(seeds, names[::-1], shard=(1, 2)), out=out, progress=False)
    cal.run(cal.calibration_tasks(seeds, names, shard=(0, 2)), out=two, progress=False)
    with two.open("a") as f:
        f.write('{"trial": {"candidate": "reference", "se')
    args = ["calibrate", "--seeds", str(seeds), "--trials", str(out)]
    assert main([*args, "--merge", str(two), "--markdown", str(md)]) == 0
    assert "cut off" in capsys.readouterr().err
    assert main([*args, "--report-only", "--markdown", str(only)]) == 0
    assert md.read_text() == only.read_text() and "cut off" not in md.read_text()
    for name in names:
        args += ["--candidate", name]
    assert main([*args, "--seeds", str(seeds + 1), "--resume", "--max-minutes", "1e-9", "--quiet",
                 "--markdown", str(md)]) == 1
    assert "not graded yet" in capsys.readouterr().err
    assert main([*args, "--report-only", "--markdown", str(only)]) == 0
    assert md.read_text() == only.read_text() and "| online-softmax |" in md.read_text()


def test_the_committed_report_is_the_committed_trials_table():
    """calibration/REPORT.md is what ``calibrate --report-only`` writes from calibration/trials.jsonl: no
    figure in it is typed by hand, and it says how many seeds of each set the trials cover."""
    repo = Path(__file__).resolve().parent.parent
    trials, notes = cal.read_trials(repo / cal.TRIALS_PATH)
    table = (repo / cal.REPORT_PATH).read_text()
    assert table == cal_report.report(trials, notes=notes)
    s = cal_report.summary(trials)
    assert f"{s['seeds']['calibration']} calibration seeds" in table and f"{s['seeds']['held-out']} held-out seeds" in table


@pytest.mark.slow  # it draws a full-level seed (about 14 CPU-s)
def test_the_committed_trials_are_of_todays_problems_and_policy():
    """The committed trials were drawn from today's full level less the slots added since
    (``UNCALIBRATED_SLOTS``, each a slot drawn today) and judged by today's policy; those slots are named
    wherever the calibration is stated. With none left out, the file would resume as it is."""
    from tpu_kernel_records_tools.grading import tolerance

    repo = Path(__file__).resolve().parent.parent
    found = trials_file.read(repo / cal.TRIALS_PATH)
    assert found.header == cal.header("full", cal.distribution_digest("full", leave_out=cal.UNCALIBRATED_SLOTS))
    if cal.UNCALIBRATED_SLOTS:
        assert found.header != cal.header("full", cal.distribution_digest("full"))  # the tuple is needed
        drawn = {cal.slot_of(p.label) for p in cal.seed_problems(0, "full", cal.FEATURES, prepare=False)}
        cal._forget(0, "full")
        doc = " ".join(tolerance.__doc__.split())
        card = " ".join((repo / "dataset_card.md").read_text().split())
        for slot in cal.UNCALIBRATED_SLOTS:
            assert slot in drawn and f"``{slot}``" in doc and f"`{slot}`" in card, slot


def test_compiled_programs_are_let_go_before_the_mappings_run_out(monkeypatch, tmp_path):
    import jax

    cleared = []
    monkeypatch.setattr(jax, "clear_caches", lambda: cleared.append(True))
    runners = cal.Runners()
    runners._kept["reference"] = object()
    monkeypatch.setattr(cal, "mappings_limit", lambda: 1000)
    monkeypatch.setattr(cal, "memory_mappings", lambda: 1000)
    assert not cal.release_compiled(runners) and runners._kept and not cleared
    monkeypatch.setattr(cal, "memory_mappings", lambda: 1001)
    assert cal.release_compiled(runners) and not runners._kept and cleared
    assert cal.release_compiled(cal.Runners(), limit=10**9, now=True)  # a new slot group: whatever the count
    monkeypatch.undo()
    assert cal.memory_mappings() is None or cal.memory_mappings() > 10
    kernel = int(Path("/proc/sys/vm/max_map_count").read_text()) if Path("/proc/sys/vm/max_map_count").exists() else 65_530
    assert cal.mappings_limit() == max(kernel - cal.MAPPINGS_MARGIN, kernel // 2)
    assert 65_530 - cal.MAPPINGS_MARGIN >= 65_530 // 2 and cal.MAPPINGS_MARGIN >= 10_000  # a trial adds thousands
    monkeypatch.setattr(cal, "Path", lambda path: tmp_path / "missing")  # unreadable: the default limit
    assert cal.mappings_limit() == 65_530 - cal.MAPPINGS_MARGIN


def test_a_new_shard_file_seeded_from_the_committed_one_grades_nothing_twice(tmp_path, graded):
    """docs/DEVELOPING.md's order: the committed trials merged into the second shard's new file first."""
    committed, shard = tmp_path / "trials.jsonl", tmp_path / "shard-1.jsonl"
    g = cal.SLOT_GROUP
    cal.run(cal.calibration_tasks(g + 2, ["a"]), out=committed, progress=False)  # into the second group: g, g + 1
    assert cal.merge(shard, [committed])[0] == 2 * g + 4
    assert trials_file.read(shard).header == trials_file.read(committed).header
    graded.clear()
    cal.run(cal.calibration_tasks(2 * g, ["a"], shard=(1, 2)), out=shard, resume=True, progress=False)
    assert graded == [("a", s) for s in (*range(g + 2, 2 * g), *range(1000 + g + 2, 1000 + 2 * g))]


def test_the_documented_dask_wall_time_is_the_recorded_one():
    """docs/DEVELOPING.md's wall times on Dask are what ``scripts/time_calibrate.py --record`` measured, and its
    estimate for the committed trials follows from them and the report's CPU-hours, not typed by hand."""
    repo = Path(__file__).resolve().parent.parent
    record = json.loads((repo / "scripts" / "time_calibrate.json").read_text())
    assert record["command"][:2] == ["tpu-kernel-records", "calibrate"] and not any(record["exit_codes"])
    serial, dask = record["serial"], record["workers_2"]
    hours = cal_report.summary(cal.read_trials(repo / cal.TRIALS_PATH)[0])["pure_trials"]["cpu_hours"]
    developing = " ".join((repo / "docs" / "DEVELOPING.md").read_text().split())
    assert (f"`python scripts/time_calibrate.py --seeds {record['seeds_per_set']} --record "
            f"scripts/time_calibrate.json` timed `calibrate --seeds {record['seeds_per_set']}`") in developing
    assert (f"on {record['machine']}: {serial['wall_s']:.0f} s of wall time serially ({serial['cpu_s']:.0f} "
            f"CPU-seconds) and {dask['wall_s']:.0f} s on a 2-worker LocalCluster ({dask['cpu_s']:.0f} CPU-seconds)"
            ) in developing
    assert (f"the committed trials' {hours:.0f} CPU-hours take about {hours * dask['wall_s'] / serial['cpu_s']:.0f} "
            f"hours of wall time on 2 such workers") in developing


def test_the_documented_cost_is_the_committed_trials():
    """The cost figures in this module's docstring and in docs/DEVELOPING.md are the committed trials' (the
    one machine's whose trials the report prices), not typed by hand."""
    import re

    repo = Path(__file__).resolve().parent.parent
    s = cal_report.summary(cal.read_trials(repo / cal.TRIALS_PATH)[0])
    doc = " ".join(cal.__doc__.split())
    assert f"**{s['cpu_s_per_trial']:.1f} CPU-s per candidate-seed**" in doc
    assert f"{s['shared_cpu_s_per_trial']:.1f} of them the trial's share" in doc
    assert f"here {s['cost_machine']}," in doc and f"over the {s['cost_trials']} trials graded there" in doc
    assert (f"its trials cost {s['first_seed_cpu_s_per_trial']:.1f} CPU-s each, the other seeds' "
            f"{s['other_seeds_cpu_s_per_trial']:.1f}") in doc
    own = {name: cpu for name, cpu in s["own_cpu_s_per_trial"].items() if name not in cal.KERNELS}
    assert f"the candidate's own {min(own.values()):.1f}-{max(own.values()):.1f}" in doc
    assert "(" + ", ".join(f"{name} {cpu:.1f}" for name, cpu in own.items()) + ")" in doc
    hours = round(s["cpu_s_per_trial"] * 400 * len(own) / 3600)
    assert (f"At {s['cpu_s_per_trial']:.0f} CPU-s, 200 + 200 seeds of the {len(own)} correct pure-JAX built-ins "
            f"are about {hours} CPU-hours") in doc
    where = "" if s["kernel_cost_machine"] == s["cost_machine"] else f", on {s['kernel_cost_machine']}"
    kernels = ", ".join(f"{name} {cpu:.0f}" for name, cpu in s["kernel_own_cpu_s_per_trial"].items())
    assert f"(their own CPU-s per seed at the full level{where}: {kernels})" in doc
    developing = " ".join((repo / "docs" / "DEVELOPING.md").read_text().split())
    assert re.search(rf"Cost: about {s['cpu_s_per_trial']:.0f} CPU-seconds per candidate and seed", developing)
    assert f"200 + 200 seeds of the {len(own)} pure-JAX correct built-ins are about {hours} CPU-hours" in developing
    assert (f"the first seed of a group compiles: {s['first_seed_cpu_s_per_trial']:.0f}; "
            f"the others {s['other_seeds_cpu_s_per_trial']:.0f}") in developing


def test_the_tolerance_docstring_and_the_card_state_the_committed_calibration():
    """``grading/tolerance.py``'s calibration table and the card's sentence are the committed trials', and what
    they promise holds: the rule gives the policy's k, the held-out seeds stay within it, no correct trial of
    either set was rejected."""
    from tpu_kernel_records_tools.grading import tolerance

    repo = Path(__file__).resolve().parent.parent
    trials = cal.read_trials(repo / cal.TRIALS_PATH)[0]
    s = cal_report.summary(trials)
    assert (s["rule"]["forward"], s["rule"]["gradient"]) == (tolerance.K_FORWARD, tolerance.K_GRADIENT)
    held, pol = s["held_out_largest"], s["policy"]
    assert held["forward"] <= pol["forward"] and held["gradient"] <= pol["gradient"]
    rejects = sum(e["rejects"] for entries in s["sets"].values() for e in entries.values())
    assert rejects == 0
    doc = " ".join(tolerance.__doc__.split())
    calib, held_out = s["sets"]["calibration"], s["sets"]["held-out"]
    for name, c in calib.items():
        h = held_out[name]
        assert (f"{name} {len(c['seeds'])} {c['forward']:.2f} / {c['gradient']:.2f} {len(h['seeds'])} "
                f"{h['forward']:.2f} / {h['gradient']:.2f}") in doc, name
    largest = {g: max(e[g] for e in calib.values()) for g in ("forward", "gradient")}
    for which, first in (("calibration", 0), ("held-out", cal.HELD_OUT_FIRST_SEED)):
        n = s["seeds"][which]
        assert f"{n} {which} seeds ({first}-{first + n - 1})" in doc
    assert (f"forward {s['rule']['forward']} ({cal.RULE_MARGIN} x {largest['forward']:.2f}), gradient "
            f"{s['rule']['gradient']} ({cal.RULE_MARGIN} x {largest['gradient']:.2f})") in doc
    assert f"at most {held['forward']:.2f} forward and {held['gradient']:.2f} gradient" in doc
    assert f"{rejects} of {len(trials)} correct trials rejected" in doc
    floor = s["floor_needed"]
    assert f"{floor['calibration']:.2f} (calibration) and {floor['held-out']:.2f} (held-out)" in doc
    card = " ".join((repo / "dataset_card.md").read_text().split())
    assert (f"on {s['seeds']['calibration']} calibration and {s['seeds']['held-out']} held-out seeds of the "
            f"grader's full level") in card
    assert (f"needed at most {max(largest['forward'], held['forward']):.2f} forward and "
            f"{max(largest['gradient'], held['gradient']):.2f} for gradients; {rejects} of {len(trials)} correct "
            f"trials were rejected") in card


def test_cpu_seconds_are_user_plus_system_time_of_this_process_or_its_children(monkeypatch):
    import resource
    from types import SimpleNamespace

    asked = []
    monkeypatch.setattr(resource, "getrusage", lambda who: asked.append(who) or SimpleNamespace(ru_utime=2.0,
                                                                                                 ru_stime=3.0))
    assert cal._cpu_s() == 5.0 and cal._cpu_s(children=True) == 5.0
    assert asked == [resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN]


def test_a_shard_past_the_last_and_a_file_of_another_kind_are_refused(tmp_path, graded):
    with pytest.raises(ValueError, match="shard"):
        cal.calibration_tasks(4, ["a"], shard=(3, 2))
    audit = tmp_path / "audit.jsonl"
    audit.write_text(json.dumps({"sweep": {"kind": "audit"}}) + "\n")
    one = tmp_path / "one.jsonl"
    cal.run([("a", 0)], out=one, progress=False)
    with pytest.raises(ValueError, match="is not a calibration's trials file"):
        cal.merge(audit, [one])
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"sweep": {**trials_file.read(one).header["sweep"], "problems": "yesterday"}}) + "\n")
    with pytest.raises(ValueError, match="other.jsonl holds another sweep"):  # the first source's line is the one
        cal.merge(tmp_path / "new.jsonl", [one, other])
