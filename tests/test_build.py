"""The builder: the published record and a CPU run become records; every refusal writes nothing;
rebuilds are byte-identical. Everything runs on temporary copies, never on the repository's data/."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import release_fixtures as testing
from tpu_kernel_records_tools.cli import main as commands
from tpu_kernel_records_tools.builder.build import BuildError, build
from release_fixtures import PUBLISHED, REPO, tree_hash
from tpu_kernel_records_tools.builder.verify import verify
from tpu_kernel_records_tools.records import rawio
from tpu_kernel_records_tools.records.schema import CONFIG_NAMES, FEATURES


def _table(data: Path, config: str, record: str) -> list[dict]:
    return pq.read_table(data / config / f"{record}.parquet").to_pylist()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A workspace with the published record and the synthetic CPU run built into data/."""
    ws = testing.workspace(tmp_path_factory.mktemp("built"))
    testing.write(ws / "runs", "synthetic-cpu")
    build([ws / "runs" / PUBLISHED], ws / "data")
    build([ws / "runs" / "synthetic-cpu"], ws / "data", allow_interpret=True)
    return ws


@pytest.fixture
def ws(built, tmp_path) -> Path:
    """A private copy of ``built``."""
    return Path(shutil.copytree(built, tmp_path / "ws", symlinks=True))


def test_published_record_is_the_cards_summary(built):
    data, raw = built / "data", json.loads((built / "runs" / PUBLISHED / "benchmark.json").read_text())
    rows = _table(data, "benchmark", PUBLISHED)
    assert len(rows) == 20 and {r["source"] for r in rows} == {"published-summary"}
    assert [r["median_ms"] for r in rows] == [c["median_ms"] for c in raw["cases"]]
    assert all(r["samples_ms"] == [] and r["num_samples"] == 0 and r["samples_per_case"] == 20
               and r["warmups"] == 5 for r in rows)
    assert all(r[k] is None for r in rows for k in ("min_ms", "max_ms", "iqr_ms", "ratio_ci_low", "batch", "causal"))
    ratios = {r["case_id"]: r["ratio_to_baseline"] for r in rows if r["ratio_to_baseline"] is not None}
    assert ratios == {p["numerator"]: p["ratio"] for p in raw["pairs"]} and len(ratios) == 10
    assert ratios["attention-pallas-s2048"] == 2.38 and not any(r["interpret"] for r in rows)

    checks = _table(data, "correctness", PUBLISHED)
    assert len(checks) == 7 and all(r["passed"] and r["measured"] for r in checks)
    assert {r["check"] for r in checks} >= {"grouped-query-mapping", "causal-mask", "qkv-gradient-parity"}
    (env,) = _table(data, "environment", PUBLISHED)
    assert (env["device_count"], env["devices_used"], env["expected_device_count"]) == (8, 1, 8)
    assert (env["jax"], env["jaxlib"]) == ("0.6.2", "0.6.2") and env["source"] == "published-summary"
    assert [(b["jax"], b["outcome"]) for b in env["bootstrap"]] == [("0.10.2", "rejected"), ("0.6.2", "used")]
    assert verify(data) == []


def test_interpret_run_is_flagged_in_every_row(built):
    data = built / "data"
    for config in CONFIG_NAMES:
        rows = _table(data, config, "synthetic-cpu")
        assert rows and all(r["interpret"] is True and r["source"] == "measured" for r in rows)
    bench = _table(data, "benchmark", "synthetic-cpu")
    assert all(len(r["samples_ms"]) == r["samples_per_case"] == 3 for r in bench)
    power = [r for r in _table(data, "correctness", "synthetic-cpu") if r["row_kind"] == "power"]
    assert [(r["candidate"], r["trials"], r["rejected"]) for r in power] == [("ignores-causal", 4, 4),
                                                                            ("reference", 4, 0)]
    assert power[0]["rejected_by"] == [{"check": "causal-mask", "count": 4}]
    assert (power[0]["expected"], power[0]["intended_checks"], power[0]["rejected_by_intended"]) == (
        "reject", ["causal-mask"], 4)
    # Structs, not JSON text: each field is a column a user can filter on.
    assert power[0]["power_detail"]["seconds_per_trial"] == 0.5 and power[0]["power_detail"]["other"] == []
    assert power[1]["power_detail"]["seconds_per_trial"] is None
    settings = power[0]["power_settings"]
    assert (settings["seeds"], settings["shapes"][0]["name"], settings["policy"]["k_forward"],
            settings["policy"]["k_gradient"]) == (2, "A", 2.0, 3.0)
    card = (built / "dataset_card.md").read_text()
    assert ("| `synthetic-cpu` | ignores-causal | attention | known-bad | reject | 4 | 4 | 100% | causal-mask: 4 | — |"
            in card)
    assert "Record `synthetic-cpu` (measured on cpu: the grader's numerics, not kernel speed): 2 seeds (0..1)" in card
    assert "`published-tpu-v5e-8` | published-summary | tpu | TPU v5e | 8 / 1" in card


def test_parquet_uses_the_declared_schema_and_small_row_groups(built):
    for config in CONFIG_NAMES:
        path = built / "data" / config / f"{PUBLISHED}.parquet"
        assert pq.read_schema(path).equals(FEATURES[config], check_metadata=True)
        meta = pq.ParquetFile(path).metadata
        assert all(meta.row_group(i).num_rows <= 64 for i in range(meta.num_row_groups))


def test_rebuild_is_byte_identical(built, tmp_path):
    again = testing.workspace(tmp_path / "again")
    testing.write(again / "runs", "synthetic-cpu")
    build([again / "runs" / PUBLISHED], again / "data")
    build([again / "runs" / "synthetic-cpu"], again / "data", allow_interpret=True)
    files = sorted(p.relative_to(built).as_posix() for p in (built / "data").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(again).as_posix() for p in (again / "data").rglob("*") if p.is_file())
    for rel in files + ["dataset_card.md"]:
        assert (built / rel).read_bytes() == (again / rel).read_bytes(), rel
    # Regenerating everything from data/raw, and replacing a record by itself, change no byte either.
    before = tree_hash(again / "data", again / "dataset_card.md")
    build([], again / "data")
    build([again / "runs" / PUBLISHED], again / "data", replace=True)
    assert tree_hash(again / "data", again / "dataset_card.md") == before


def _corrupt_json(run: Path) -> None:
    testing.resign(run, "benchmark.json", b'{"format_version": 1,')


def _missing_file(run: Path) -> None:
    (run / "correctness.json").unlink()


def _checksum(run: Path) -> None:
    doc = json.loads((run / "environment.json").read_text())
    doc["device_count"] = 2
    (run / "environment.json").write_bytes(rawio.dumps(doc))


def _nan_sample(run: Path) -> None:
    doc = json.loads((run / "benchmark.json").read_text())
    doc["cases"][1]["samples_ms"][2] = math.nan
    testing.rewrite(run, "benchmark", doc)


def _negative_sample(run: Path) -> None:
    doc = json.loads((run / "benchmark.json").read_text())
    doc["cases"][0]["samples_ms"][0] = -1.0
    testing.rewrite(run, "benchmark", doc)


def _failed_case(run: Path) -> None:
    doc = json.loads((run / "benchmark.json").read_text())
    doc["cases"][3].update(status="failed", error="RESOURCE_EXHAUSTED")
    testing.rewrite(run, "benchmark", doc)


def _failed_check(run: Path) -> None:
    doc = json.loads((run / "correctness.json").read_text())
    doc["scorecards"][1]["checks"][2]["passed"] = False
    testing.rewrite(run, "correctness", doc)


def _summary_with_samples(run: Path) -> None:
    doc = json.loads((run / "benchmark.json").read_text())
    doc["cases"][0]["samples_ms"] = [0.17]
    testing.rewrite(run, "benchmark", doc)


def _name_outside(run: Path) -> None:
    """A file beside the data folder listed as ``../../../x``: copied as listed, it would land
    outside the record's folder (its checksum is right; only the name is wrong)."""
    testing.resign(run, "../../../outside.txt", b"planted")


def _link_to_outside(run: Path) -> None:
    """A listed link to a file outside the run: copied, it would put that file's bytes in data/."""
    (run.parent / "secret.txt").write_bytes(b"not for the record")
    data = (run.parent / "secret.txt").read_bytes()
    testing.resign(run, "evidence.txt", data)
    (run / "evidence.txt").unlink()
    (run / "evidence.txt").symlink_to(run.parent / "secret.txt")


REFUSALS = {
    # name: (run to damage, damage, rule, file, field)
    "corrupt-json": ("synthetic-cpu-2", _corrupt_json, "corrupt-json", "benchmark.json", None),
    "missing-file": ("synthetic-cpu-2", _missing_file, "missing-file", "correctness.json", None),
    "checksum": ("synthetic-cpu-2", _checksum, "checksum", "environment.json", None),
    "nan-sample": ("synthetic-cpu-2", _nan_sample, "samples", "benchmark.json", "cases/1/samples_ms/2"),
    "negative-sample": ("synthetic-cpu-2", _negative_sample, "samples", "benchmark.json", "cases/0/samples_ms/0"),
    "failed-case": ("synthetic-cpu-2", _failed_case, "benchmark-case", "benchmark.json", "cases/3/status"),
    "failed-check": ("synthetic-cpu-2", _failed_check, "correctness", "correctness.json",
                     "scorecards/1/checks/2/passed"),
    "name-outside": ("synthetic-cpu-2", _name_outside, "schema", "manifest.json", "files"),
    "link": ("synthetic-cpu-2", _link_to_outside, "not-a-plain-file", "evidence.txt", None),
    "summary-samples": (PUBLISHED, _summary_with_samples, "published-summary", "benchmark.json",
                        "cases/0/samples_ms"),
}


def _assert_untouched(ws: Path, before: str, listing: list[str]) -> None:
    assert tree_hash(ws / "data", ws / "dataset_card.md") == before
    assert sorted(os.listdir(ws)) == listing, "a temporary folder was left behind"


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refused_run_names_rule_file_field_and_writes_nothing(ws, case):
    run_id, damage, rule, file, field = REFUSALS[case]
    if run_id == PUBLISHED:
        run = Path(shutil.copytree(ws / "runs" / PUBLISHED, ws / "runs" / "damaged"))
        replace = True
    else:
        run, replace = testing.write(ws / "runs", run_id), False
    damage(run)
    before, listing = tree_hash(ws / "data", ws / "dataset_card.md"), sorted(os.listdir(ws))
    with pytest.raises(BuildError) as err:
        build([run], ws / "data", allow_interpret=True, replace=replace)
    assert (err.value.rule, err.value.file, err.value.field) == (rule, str(run / file), field)
    assert f"[{rule}]" in str(err.value) and file in str(err.value)
    _assert_untouched(ws, before, listing)


def test_tpu_run_must_show_every_device_of_its_slice(ws):
    before, listing = tree_hash(ws / "data", ws / "dataset_card.md"), sorted(os.listdir(ws))
    for kwargs in ({"device_count": 4}, {"device_count": 1, "env_vars": {}, "device_kind": "TPU v5 lite"},
                   {"env_vars": {"TPU_ACCELERATOR_TYPE": "v5litepod-4"}}):
        run = testing.tpu(ws / "runs", f"synthetic-tpu-{len(os.listdir(ws / 'runs'))}", **kwargs)
        with pytest.raises(BuildError) as err:
            build([run], ws / "data")
        assert (err.value.rule, err.value.field) == ("slice-devices", "device_count")
        assert "slice has" in str(err.value)
    _assert_untouched(ws, before, listing)
    build([testing.tpu(ws / "runs", "synthetic-tpu-ok")], ws / "data")
    (env,) = _table(ws / "data", "environment", "synthetic-tpu-ok")
    assert (env["device_count"], env["expected_device_count"], env["interpret"]) == (8, 8, False)


def test_interpret_run_refused_without_flag(ws):
    run = testing.write(ws / "runs", "synthetic-cpu-3")
    before, listing = tree_hash(ws / "data", ws / "dataset_card.md"), sorted(os.listdir(ws))
    with pytest.raises(BuildError) as err:
        build([run], ws / "data")
    assert (err.value.rule, err.value.field) == ("interpret", "interpret") and "--allow-interpret" in str(err.value)
    _assert_untouched(ws, before, listing)


def test_duplicate_record_id_refused_unless_replace(ws, capsys):
    before, listing = tree_hash(ws / "data", ws / "dataset_card.md"), sorted(os.listdir(ws))
    code = commands.main(["build", str(ws / "runs" / PUBLISHED), "--data", str(ws / "data")])
    assert code == 1 and "[duplicate-record]" in capsys.readouterr().err
    twice = testing.write(ws / "runs2", "synthetic-new")
    with pytest.raises(BuildError, match="given twice"):
        build([twice, twice], ws / "data", allow_interpret=True)
    _assert_untouched(ws, before, sorted(listing + ["runs2"]))


def test_a_failure_mid_build_leaves_data_untouched(ws, monkeypatch):
    run = testing.write(ws / "runs", "synthetic-cpu-4")
    before, listing = tree_hash(ws / "data", ws / "dataset_card.md"), sorted(os.listdir(ws))

    def disk_full(table, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("tpu_kernel_records_tools.builder.build.write_parquet", disk_full)
    with pytest.raises(OSError, match="No space"):
        build([run], ws / "data", allow_interpret=True)
    _assert_untouched(ws, before, listing)


def test_new_record_leaves_old_files_alone(ws):
    old = {p: p.read_bytes() for p in (ws / "data").glob("*/published-tpu-v5e-8.parquet")}
    build([testing.write(ws / "runs", "synthetic-cpu-5")], ws / "data", allow_interpret=True)
    assert old and all(path.read_bytes() == data for path, data in old.items())
    assert (ws / "data" / "benchmark" / "synthetic-cpu-5.parquet").is_file() and verify(ws / "data") == []


@pytest.mark.slow  # a real interpret-mode benchmark, about 35 s; the default run stays within 5 minutes
def test_real_tiny_cpu_run_builds_with_allow_interpret(tmp_path, monkeypatch):
    from tpu_kernel_records_tools.measure import run as run_module

    # Grading the Pallas kernel in interpret mode takes minutes on a CPU: grade cheap candidates instead, at
    # the quick level (a CPU profile's runs may be; the full level is test_measure_run's); the benchmark is real.
    grade = run_module.grade
    monkeypatch.setattr(run_module, "grade", lambda kernels, *, seed, progress, known_bad=None, kernel_level=None, **_: grade(
        ["reference"], seed=seed, progress=progress, known_bad=["zeros"], kernel_level="quick"))
    monkeypatch.setattr(run_module, "measured_candidates", lambda profile, scopes: ("reference", ["reference"]))
    # the tiny profile's paged decode step too (issue 36): its cache columns and bytes reach the tables
    run = testing.stand_in_kernel_cards(run_module.run_measure(
        tmp_path / "tiny", profile="tiny", warmups=1, samples=2, scopes=["softmax", "paged-decode"], progress=False))
    ws = testing.workspace(tmp_path / "ws")
    with pytest.raises(BuildError, match=r"\[interpret\]"):
        build([run], ws / "data")
    (record,) = build([run], ws / "data", allow_interpret=True)
    rows = _table(ws / "data", "benchmark", record)
    assert rows and all(r["interpret"] or r["implementation"] == "paged-xla" for r in rows)
    assert all(r["platform"] == "cpu" and len(r["samples_ms"]) == 2 for r in rows)
    assert verify(ws / "data") == []
    paged_rows_carry_their_cache(ws / "data", record, rows, "tiny", configs=("benchmark",))


def paged_rows_carry_their_cache(data: Path, record: str, rows: list[dict], profile: str,
                                 configs: tuple[str, ...] = CONFIG_NAMES) -> None:
    """The paged columns: null for every other case, the case's cache for a paged one; bytes_moved the K/V of
    the keys each sequence's new row sees (counted key by key), q and out; ``configs`` load with ``datasets``."""
    import datasets

    from tpu_kernel_records_tools.bench.cases import get_profile

    paged = {r["case_id"]: r for r in rows if r["scope"] == "paged-decode"}
    assert paged and all(r["page_size"] is r["pages"] is r["pool_pages"] is None
                         for r in rows if r["scope"] != "paged-decode")
    models = {m.name: m for m in get_profile(profile).paged}
    for r in paged.values():
        m = models[r["model"]]
        assert r["implementation"] in ("paged-pallas", "paged-xla") and r["q_len"] == 1
        assert (r["pages"], r["pool_pages"]) == (r["kv_len"] // r["page_size"], r["batch"] * r["pages"])
        assert r["page_size"] in m.page_sizes and r["window"] == (None if m.window is None else dict(
            left=m.window[0], right=m.window[1]))
        keys = sum(sum(1 for j in range(n) if m.window is None or n - 1 - j <= m.window[0])
                   for n in m.lengths(r["kv_len"]))
        assert r["bytes_moved"] == 2 * (keys * m.num_kv_heads + r["batch"] * m.num_q_heads) * m.head_dim * 2
    assert {(r["model"], r["page_size"]) for r in paged.values()} == {
        (m.name, p) for m in models.values() for _, p in m.variants()}
    loaded = {config: datasets.load_dataset("parquet", data_files=str(data / config / f"{record}.parquet"),
                                            split="train", cache_dir=str(data.parent / "hf-cache"))
              for config in configs}
    assert all(ds.features == datasets.Features.from_arrow_schema(FEATURES[c]) for c, ds in loaded.items())
    assert {r["case_id"]: r["pool_pages"] for r in loaded["benchmark"] if r["case_id"] in paged} == {
        k: r["pool_pages"] for k, r in paged.items()}


def test_repository_data_verifies():
    """The committed release (record #1) is current: checksums, tables, figure data and card."""
    assert verify(REPO / "data", REPO / "dataset_card.md") == []


def test_a_case_in_several_pairs_keeps_them_all_with_xla_as_primary(ws):
    run = testing.write(ws / "runs", "synthetic-gpu", platform="gpu", interpret=False,
                        device_kind="NVIDIA H100 80GB HBM3", scopes=("flash",))
    build([run], ws / "data")
    row = next(r for r in _table(ws / "data", "benchmark", "synthetic-gpu") if r["case_id"] == "flash-flash-s128")
    assert [p["baseline_case_id"] for p in row["pairs"]] == ["flash-xla-s128", "flash-cudnn-s128"]
    xla = next(p for p in row["pairs"] if p["baseline_case_id"] == "flash-xla-s128")
    assert (row["baseline_case_id"], row["ratio_to_baseline"]) == ("flash-xla-s128", xla["ratio"])
    assert "flash / cudnn" not in (ws / "dataset_card.md").read_text()


def test_two_builds_at_once_lose_no_record(ws):
    """Each build copies data/, adds its record and swaps; the lock makes the second start from the first's result."""
    import threading

    runs = [testing.write(ws / "runs", f"synthetic-cpu-{n}") for n in (6, 7)]
    errors = []

    def one(run):
        try:
            build([run], ws / "data", allow_interpret=True)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(run,)) for run in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert {"synthetic-cpu-6", "synthetic-cpu-7"} <= set(os.listdir(ws / "data" / "raw"))
    assert verify(ws / "data") == []


def test_a_held_lock_refuses_after_the_timeout_and_writes_nothing(ws, monkeypatch):
    import hashlib
    import tempfile

    from filelock import FileLock

    monkeypatch.setattr("tpu_kernel_records_tools.builder.build.LOCK_TIMEOUT_S", 0.2)
    key = hashlib.sha256(str((ws / "data").resolve()).encode()).hexdigest()[:16]
    run = testing.write(ws / "runs", "synthetic-cpu-8")
    before, listing = tree_hash(ws / "data", ws / "dataset_card.md"), sorted(os.listdir(ws))
    with FileLock(str(Path(tempfile.gettempdir()) / f"tpu-kernel-records-build-{key}.lock")):
        with pytest.raises(BuildError) as err:
            build([run], ws / "data", allow_interpret=True)
    assert err.value.rule == "lock" and "another build" in str(err.value)
    _assert_untouched(ws, before, listing)


def test_each_scorecard_row_carries_the_isolation_it_was_graded_under(tmp_path):
    def mark(docs):
        cards = docs["correctness"]["scorecards"]
        cards[0]["isolation"], cards[1]["isolation"] = "process", "bubblewrap"  # the third predates the field
    ws = testing.workspace(tmp_path / "ws")
    build([testing.write(ws / "runs", "synthetic-cpu-iso", edit=mark)], ws / "data", allow_interpret=True)
    rows = _table(ws / "data", "correctness", "synthetic-cpu-iso")
    where = {(r["row_kind"], r["candidate"], r["isolation"]) for r in rows}
    assert where == {("check", "reference", "process"), ("check", "pallas", "bubblewrap"),
                     ("check", "ignores-causal", None), ("power", "ignores-causal", None), ("power", "reference", None)}
    assert verify(ws / "data") == []
