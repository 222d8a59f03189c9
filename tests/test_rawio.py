"""records.rawio: schema validation, manifest checksums, atomic run folders."""

import json
import os

import pytest

from tpu_kernel_records_tools.records import rawio


def _docs(run_id="cpu-test-run"):
    env = {
        "format_version": 1, "run_id": run_id, "source": "measured", "created_utc": "2026-12-02T00:00:00Z",
        "profile": "tiny", "platform": "cpu", "device_kind": "cpu", "device_count": 1, "devices_used": 1,
        "process_count": 1, "interpret": True,
        "versions": {"jax": "x", "jaxlib": "x", "libtpu": None, "gpu_plugin": None, "python": None,
                     "numpy": None, "os": None},
        "cpu_model": None, "git_commit": None, "kernel_src_sha256": None, "env_vars": {},
        "bootstrap": [], "notes": None,
    }
    corr = {"format_version": 1, "run_id": run_id, "source": "measured", "seed": 0, "measured_candidate": "pallas",
            "scorecards": [{"candidate": "pallas", "kind": "kernel", "passed": True, "score": 1.0, "max_score": 1.0,
                            "checks": [{"name": "c", "passed": True, "points": 1.0, "max_points": 1.0,
                                        "detail": "ok"}]}],
            "power": None}
    bench = {"format_version": 1, "run_id": run_id, "source": "measured", "profile": "tiny", "platform": "cpu",
             "interpret": True, "warmups": 0, "samples_per_case": 1, "cases": [{
                 "case_id": "attention-xla-s8", "scope": "attention", "implementation": "xla", "seq_len": 8,
                 "shape": {"batch": 1, "q_len": 8, "kv_len": 8, "num_q_heads": 4, "num_kv_heads": 2, "head_dim": 8},
                 "dtype": "bfloat16", "causal": True, "padded": False, "devices_used": 1, "status": "ok",
                 "error": None, "interpret": False, "transfer_ms": 0.1, "lower_ms": 1.0, "compile_ms": 2.0,
                 "samples_ms": [0.5], "median_ms": 0.5, "min_ms": 0.5, "max_ms": 0.5, "q1_ms": 0.5, "q3_ms": 0.5,
                 "iqr_ms": 0.0, "peak_memory_bytes": None, "flops": 1.0, "bytes_moved": 1.0, "tflops": None,
                 "gbps": None, "peak_flops_fraction": None, "peak_bandwidth_fraction": None,
                 "stablehlo": "stablehlo/attention-xla-s8.mlir.gz", "stablehlo_tpu": None}],
             "pairs": []}
    return {"environment": env, "correctness": corr, "benchmark": bench}


def test_write_then_read_round_trips(tmp_path):
    run = rawio.write_run(tmp_path / "run", _docs(), {"stablehlo/attention-xla-s8.mlir.gz": b"\x1f\x8b"})
    loaded = rawio.read_run(run)
    assert loaded["benchmark"]["cases"][0]["median_ms"] == 0.5
    assert set(loaded["manifest"]["files"]) == {
        "environment.json", "correctness.json", "benchmark.json", "stablehlo/attention-xla-s8.mlir.gz"}
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_invalid_document_writes_nothing(tmp_path):
    docs = _docs()
    docs["benchmark"]["cases"][0]["median_ms"] = "fast"
    with pytest.raises(rawio.RunError, match=r"cases/0/median_ms"):
        rawio.write_run(tmp_path / "run", docs)
    assert list(tmp_path.iterdir()) == []


def test_nan_is_refused_and_existing_run_untouched(tmp_path):
    run = rawio.write_run(tmp_path / "run", _docs())
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    docs = _docs()
    docs["benchmark"]["cases"][0]["samples_ms"] = [float("nan")]
    with pytest.raises(ValueError):
        rawio.write_run(tmp_path / "other", docs)
    with pytest.raises(FileExistsError):
        rawio.write_run(run, _docs())
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize("damage, rule", [
    (lambda run: (run / "benchmark.json").write_text("{not json"), "checksum"),
    (lambda run: (run / "correctness.json").unlink(), "missing-file"),
    (lambda run: (run / "manifest.json").write_text("{"), "corrupt-json"),
    (lambda run: (run / "stray.txt").write_text("x"), "unlisted-file"),
    (lambda run: (run / "manifest.json").write_text("[" * 100_000 + "]" * 100_000), "corrupt-json"),
    (lambda run: (run / "manifest.json").write_text("9" * 5000), "corrupt-json"),
    (lambda run: os.truncate(run / "manifest.json", rawio.MAX_DOCUMENT_BYTES + 1), "too-large"),
])
def test_damaged_runs_name_the_rule(tmp_path, damage, rule):
    run = rawio.write_run(tmp_path / "run", _docs())
    damage(run)
    with pytest.raises(rawio.RunError) as info:
        rawio.read_run(run)
    assert info.value.rule == rule


def test_run_id_mismatch_is_caught(tmp_path):
    docs = _docs()
    docs["correctness"]["run_id"] = "another-run"
    run = rawio.write_run(tmp_path / "run", docs)
    with pytest.raises(rawio.RunError) as info:
        rawio.read_run(run)
    assert (info.value.rule, info.value.file, info.value.field) == ("run-id", "correctness.json", "run_id")


def test_schemas_ship_with_the_package():
    for name in rawio.DOCUMENTS + ("manifest",):
        schema = rawio.load_schema(name)
        assert schema["$schema"].endswith("2020-12/schema")
    json.dumps(rawio.load_schema("benchmark"))


@pytest.mark.parametrize("value", ["2026-13-01T00:00:00Z", "2026-02-30T00:00:00Z", "yesterday", "2026-01-01",
                                   "2026-01-01 00:00:00", "2026-01-01T25:00:00Z"])
def test_created_utc_must_be_a_date_time(tmp_path, value):
    docs = _docs()
    docs["environment"]["created_utc"] = value
    with pytest.raises(rawio.RunError) as err:
        rawio.write_run(tmp_path / "run", docs)
    assert (err.value.rule, err.value.field) == ("schema", "created_utc")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["2026-01-01T00:00:00Z", "2026-01-01T00:00:00.123456+00:00",
                                   "2026-06-30T23:59:59-07:00", None])
def test_created_utc_accepts_rfc3339_or_null(tmp_path, value):
    docs = _docs()
    docs["environment"]["created_utc"] = value
    run = rawio.write_run(tmp_path / "run", docs)
    assert rawio.read_run(run)["environment"]["created_utc"] == value


def _relist(run, files):
    """Rewrite ``run``'s manifest to list ``files`` (name -> bytes), checksums right: only the
    names are wrong."""
    import hashlib

    manifest = json.loads((run / rawio.MANIFEST).read_text())
    manifest["files"].update({rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()})
    (run / rawio.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["../outside.txt", "stablehlo/../../outside.txt", "/tmp/outside.txt",
                                  "./benchmark.json", "stablehlo//x.gz", ".hidden", "a\\..\\b"])
def test_a_manifest_name_that_leaves_the_folder_is_refused_before_anything_is_read(tmp_path, name):
    """A manifest whose checksums are right but whose names point outside the run folder (or are
    not plain relative names) is refused by the manifest's schema, before any listed file is read."""
    (tmp_path / "outside.txt").write_bytes(b"secret")
    run = rawio.write_run(tmp_path / "run", _docs())
    _relist(run, {name: b"secret"})
    with pytest.raises(rawio.RunError) as info:
        rawio.read_run(run)
    assert (info.value.rule, info.value.file) == ("schema", rawio.MANIFEST), info.value
    assert "does not match" in str(info.value)


def test_writing_a_run_with_a_name_outside_it_writes_nothing(tmp_path):
    with pytest.raises(rawio.RunError, match=r"\[schema\] manifest.json"):
        rawio.write_run(tmp_path / "deep" / "run", _docs(), {"../../escaped.txt": b"x"})
    assert not (tmp_path / "escaped.txt").exists()
    assert not [p for p in tmp_path.rglob("*") if not p.is_dir()]


@pytest.mark.parametrize("listed", [True, False])
def test_a_symbolic_link_in_a_run_folder_is_refused(tmp_path, listed):
    """A link (here to a file outside the run, its checksum listed right) would let the builder copy
    whatever it points at into ``data/``; listed or not, the run is refused."""
    (tmp_path / "outside.txt").write_bytes(b"secret")
    run = rawio.write_run(tmp_path / "run", _docs(), {"stablehlo/attention-xla-s8.mlir.gz": b"\x1f\x8b"})
    (run / "stablehlo" / "link.gz").symlink_to(tmp_path / "outside.txt")
    if listed:
        _relist(run, {"stablehlo/link.gz": b"secret"})
    with pytest.raises(rawio.RunError) as info:
        rawio.read_run(run)
    assert (info.value.rule, info.value.file) == ("not-a-plain-file", "stablehlo/link.gz")
