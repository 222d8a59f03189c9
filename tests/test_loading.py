"""Loading: the parquet route (datasets >= 4: load_dataset on a staged release), the script route
(datasets 3.x: load_dataset on the script with trust_remote_code; any version: the builder used
directly, the script copied alone, a release served over HTTP on 127.0.0.1), the same rows and
features either way, column types, a cache that never serves stale data, and the gated-access
message. No network beyond 127.0.0.1: the Hub is replaced by recorders."""

from __future__ import annotations

import functools
import http.server
import importlib.metadata
import importlib.util
import json
import re
import shutil
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from huggingface_hub import DatasetCard, HfApi
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError

import doc_blocks
import tpu_kernel_records as tkr
import release_fixtures as testing
from tpu_kernel_records_tools.builder.build import build
from tpu_kernel_records_tools.builder.card import PLACEHOLDER_REPO
from tpu_kernel_records_tools.builder.publish import publish
from tpu_kernel_records_tools.records.schema import CHECKSUMS, CONFIG_NAMES, DEFAULT_CONFIG, FEATURES, LICENSE, VERSION
from release_fixtures import PUBLISHED


ROWS = {"benchmark": 24, "correctness": 18, "environment": 2}
SCRIPT_ROUTE = int(datasets.__version__.split(".")[0]) < 4  # load_dataset runs loading scripts before 4.0


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """A staged release folder (as uploaded to the Hub) holding the published record and a CPU run."""
    ws = testing.workspace(tmp_path_factory.mktemp("load"))
    testing.write(ws / "runs", "synthetic-cpu")
    build([ws / "runs" / PUBLISHED, ws / "runs" / "synthetic-cpu"], ws / "data", allow_interpret=True)
    publish(ws, "me/tpu-kernel-records", VERSION, stage_dir=ws / "tpu-kernel-records-1.0.0", out=lambda line: None)
    return ws / "tpu-kernel-records-1.0.0"


def _script(path: Path, name: str = "staged_tpu_kernel_records"):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _features(config: str) -> datasets.Features:
    return datasets.Features.from_arrow_schema(FEATURES[config])


def _rows(ds) -> list[str]:
    return sorted(json.dumps(row, sort_keys=True, default=str) for row in ds)


def test_the_script_declares_what_records_schema_declares():
    assert (tkr.VERSION_STRING, tkr.CONFIG_NAMES, tkr.CHECKSUMS, tkr.LICENSE, tkr.DEFAULT_CONFIG) == (
        VERSION, CONFIG_NAMES, CHECKSUMS, LICENSE, DEFAULT_CONFIG)
    assert str(tkr.VERSION) == VERSION and importlib.metadata.version("tpu-kernel-records") == VERSION


@pytest.mark.skipif(SCRIPT_ROUTE, reason="datasets < 4 runs the script for a folder that holds one only by name")
@pytest.mark.parametrize("config", CONFIG_NAMES)
def test_parquet_route_on_the_staged_release(release, tmp_path, config):
    ds = datasets.load_dataset(str(release), config, split="train", cache_dir=str(tmp_path / "cache"))
    assert ds.num_rows == ROWS[config] and ds.features == _features(config)
    assert sorted(set(ds["record_id"])) == [PUBLISHED, "synthetic-cpu"]
    card = DatasetCard.load(release / "README.md")  # the parquet route's licence and description
    assert card.data.license == LICENSE and "Pallas" in card.text


@pytest.mark.skipif(SCRIPT_ROUTE, reason="parquet route tested on datasets >= 4")
def test_default_config_is_benchmark(release, tmp_path):
    ds = datasets.load_dataset(str(release), split="train", cache_dir=str(tmp_path / "cache"))
    assert ds.features == _features("benchmark")


def test_columns_a_user_can_use_as_they_are(release):
    env = pq.read_table(release / "data" / "environment" / f"{PUBLISHED}.parquet")
    assert env.schema.field("created_utc").type == pa.timestamp("us", tz="UTC")
    assert env.column("created_utc").to_pylist() == [None]  # the published card states no time
    synthetic = pq.read_table(release / "data" / "environment" / "synthetic-cpu.parquet")
    assert synthetic.column("created_utc").to_pylist()[0].isoformat() == "2026-01-01T00:00:00+00:00"
    correctness = pq.read_schema(release / "data" / "correctness" / "synthetic-cpu.parquet")
    assert pa.types.is_struct(correctness.field("power_detail").type)
    assert pa.types.is_struct(correctness.field("power_settings").type)
    # Standard parquet lists: every reader sees list<element>, not a legacy layout.
    parquet_schema = str(pq.ParquetFile(release / "data" / "benchmark" / "synthetic-cpu.parquet").schema)
    assert re.search(r"samples_ms \(List\) \{\s+repeated group field_id=-1 list \{\s+optional double "
                     r"field_id=-1 element;", parquet_schema)


@pytest.mark.parametrize("config", CONFIG_NAMES)
def test_script_alone_reads_through_the_download_manager(release, tmp_path, config):
    """The script copied alone (as datasets copies it into its modules cache), given only the release's
    base path: no folder beside it is globbed; files come from SHA256SUMS through the download manager."""
    alone = tmp_path / "datasets_modules" / "tpu_kernel_records.py"
    alone.parent.mkdir()
    shutil.copyfile(release / "tpu_kernel_records.py", alone)
    module = _script(alone, f"alone_{config}")
    builder = module.TpuKernelRecords(config_name=config, base_path=str(release), cache_dir=str(tmp_path / "c"))
    assert builder.info.license == LICENSE and "Laela Zorana" in builder.info.citation
    assert builder.info.homepage and builder.info.description
    builder.download_and_prepare()
    ds = builder.as_dataset(split="train")
    assert ds.num_rows == ROWS[config] and ds.features == _features(config)
    if not SCRIPT_ROUTE:  # the same rows, features and licence as the parquet route
        parquet = datasets.load_dataset(str(release), config, split="train", cache_dir=str(tmp_path / "p"))
        assert _rows(ds) == _rows(parquet) and ds.features == parquet.features


def test_script_reads_a_release_served_over_http(release, tmp_path):
    """A remote base path (as on the Hub): SHA256SUMS and the parquet files are downloaded by URL."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(release))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        module = _script(release / "tpu_kernel_records.py", "served_tpu_kernel_records")
        base = f"http://127.0.0.1:{server.server_address[1]}"
        builder = module.TpuKernelRecords(config_name="environment", base_path=base, cache_dir=str(tmp_path / "c"))
        builder.download_and_prepare()
        ds = builder.as_dataset(split="train")
    finally:
        server.shutdown()
    assert {r["record_id"]: r["interpret"] for r in ds} == {PUBLISHED: False, "synthetic-cpu": True}


@pytest.mark.skipif(not SCRIPT_ROUTE, reason="datasets >= 4 no longer runs loading scripts")
@pytest.mark.parametrize("config", CONFIG_NAMES)
def test_load_dataset_runs_the_script_on_datasets_3(release, tmp_path, config):
    ds = datasets.load_dataset(str(release / "tpu_kernel_records.py"), config, split="train",
                               cache_dir=str(tmp_path / "cache"), trust_remote_code=True)
    assert ds.num_rows == ROWS[config] and ds.features == _features(config)
    assert ds.info.license == LICENSE


@pytest.mark.skipif(not SCRIPT_ROUTE, reason="datasets >= 4 no longer runs loading scripts")
def test_script_route_serves_each_release_its_own_rows(release, tmp_path):
    """Two releases with the same script, loaded one after the other: datasets 3.x caches the module (and the
    first card beside it) by the script's hash; neither the card nor the prepared cache may leak across."""
    other = testing.workspace(tmp_path / "other")
    build([other / "runs" / PUBLISHED], other / "data")
    publish(other, "me/tpu-kernel-records", VERSION, stage_dir=other / "release", out=lambda line: None)
    cache = str(tmp_path / "cache")
    for folder, rows in ((release, ROWS["benchmark"]), (other / "release", 20), (release, ROWS["benchmark"])):
        ds = datasets.load_dataset(str(folder / "tpu_kernel_records.py"), "benchmark", split="train",
                                   cache_dir=cache, trust_remote_code=True)
        assert ds.num_rows == rows


def test_staged_script_works_standalone_by_direct_builder_use(release, tmp_path):
    module = _script(release / "tpu_kernel_records.py")
    builder = module.TpuKernelRecords(config_name="environment", cache_dir=str(tmp_path / "cache"))
    builder.download_and_prepare()
    ds = builder.as_dataset(split="train")
    assert ds.info.license == LICENSE
    assert {r["record_id"]: r["interpret"] for r in ds} == {PUBLISHED: False, "synthetic-cpu": True}
    names = [c.name for c in module.TpuKernelRecords.BUILDER_CONFIGS]
    assert names == ["benchmark", "correctness", "environment"]
    assert module.TpuKernelRecords.DEFAULT_CONFIG_NAME == "benchmark"


def test_a_damaged_download_is_refused(release, tmp_path):
    copy = Path(shutil.copytree(release, tmp_path / "copy"))
    path = copy / "data" / "environment" / "synthetic-cpu.parquet"
    path.write_bytes(path.read_bytes()[:-1] + b"\0")
    module = _script(copy / "tpu_kernel_records.py", "damaged_tpu_kernel_records")
    builder = module.TpuKernelRecords(config_name="environment", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(OSError, match="sha256 differs from SHA256SUMS"):
        builder.download_and_prepare()


def test_load_never_serves_a_stale_cache(tmp_path):
    ws = testing.workspace(tmp_path / "ws")
    build([ws / "runs" / PUBLISHED], ws / "data")
    cache = str(tmp_path / "cache")
    assert tkr.load("benchmark", data_dir=ws / "data", cache_dir=cache).num_rows == 20
    build([testing.write(ws / "runs", "synthetic-cpu")], ws / "data", allow_interpret=True)
    # Same data_dir, same cache: only the SHA256SUMS fingerprint tells the two states apart.
    assert tkr.load("benchmark", data_dir=ws / "data", cache_dir=cache).num_rows == 24


class FakeApi:
    def __init__(self, error: Exception | None = None):
        self.error, self.calls = error, []

    def auth_check(self, repo_id, **kwargs):
        self.calls.append((repo_id, kwargs))
        if self.error is not None:
            raise self.error


def _response(status: int) -> SimpleNamespace:
    return SimpleNamespace(status_code=status, headers={}, request=None)


@pytest.mark.parametrize("error", [
    GatedRepoError("Access to dataset me/tpu-kernel-records is restricted.", response=_response(401)),
    HfHubHTTPError("403 Forbidden", response=_response(403)),
])
def test_gated_access_says_how_to_get_in(error, monkeypatch):
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("must not load"))
    api = FakeApi(error)
    with pytest.raises(tkr.AccessError) as err:
        tkr.load("benchmark", repo_id="me/tpu-kernel-records", api=api)
    message = str(err.value)
    assert "hf auth login" in message and "HF_TOKEN" in message
    assert "https://huggingface.co/datasets/me/tpu-kernel-records" in message
    assert err.value.__cause__ is error and api.calls == [("me/tpu-kernel-records",
                                                           {"repo_type": "dataset", "token": None})]


def test_hub_route_calls_load_dataset_with_the_revision(monkeypatch):
    seen = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: seen.append((args, kwargs)) or "ds")
    assert tkr.load("correctness", repo_id="me/tpu-kernel-records", revision="v1.0.0", api=FakeApi()) == "ds"
    (args, kwargs), = seen
    assert args == ("me/tpu-kernel-records", "correctness") and kwargs["revision"] == "v1.0.0"


def test_unknown_config_is_refused():
    with pytest.raises(ValueError, match="config must be one of"):
        tkr.load("benchmarks")


@pytest.mark.skipif(SCRIPT_ROUTE, reason="the parquet route on a local folder is tested on datasets >= 4")
def test_the_documented_load_snippets_run_against_a_staged_release(release, tmp_path, monkeypatch):
    """Every Python block of README.md, docs/ and the card that loads from the Hub runs as written, with the
    placeholder repository served by the staged release (and the downloaded release folder it names)."""
    snippets = [b for b in doc_blocks.blocks(doc_blocks.PYTHON) if PLACEHOLDER_REPO in b.text]
    assert len(snippets) >= 4  # README's quickstart, the card's two, RELEASING's Hub check
    real, cache = datasets.load_dataset, str(tmp_path / "cache")

    def from_the_staged_release(path, *args, revision=None, **kwargs):
        assert path == PLACEHOLDER_REPO and revision in (None, f"v{VERSION}")
        return real(str(release), *args, **{**kwargs, "cache_dir": cache})

    monkeypatch.setattr(datasets, "load_dataset", from_the_staged_release)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(HfApi, "auth_check", lambda self, *args, **kwargs: None)
    (tmp_path / "tpu-kernel-records").symlink_to(release)  # the folder the card's download step names
    monkeypatch.chdir(tmp_path)
    for block in snippets:
        monkeypatch.setattr(sys, "path", list(sys.path))
        monkeypatch.delitem(sys.modules, "tpu_kernel_records", raising=False)  # the staged script, not ours
        scope: dict = {}
        exec(compile(block.text, block.where(), "exec"), scope)
        for name in ("bench", "checks", "env", "rows"):
            if name in scope:
                assert scope[name].num_rows in ROWS.values(), (block.where(), name)
