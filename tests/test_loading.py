"""Loading: datasets.load_dataset on a staged release (all three configs, the card's YAML), the loading
script used directly (standalone, with its licence), a cache that never serves stale data, and the
gated-access message. No network: the Hub is replaced by recorders."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
from huggingface_hub.errors import GatedRepoError, HfHubHTTPError

import tpu_kernel_records as tkr
import release_fixtures as testing
from builder.build import build
from builder.publish import publish
from release_fixtures import PUBLISHED


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """A staged release folder (as uploaded to the Hub) holding the published record and a CPU run."""
    ws = testing.workspace(tmp_path_factory.mktemp("load"))
    testing.write(ws / "runs", "synthetic-cpu")
    build([ws / "runs" / PUBLISHED, ws / "runs" / "synthetic-cpu"], ws / "data", allow_interpret=True)
    publish(ws, "me/tpu-kernel-records", "1.0.0", stage_dir=ws / "tpu-kernel-records-1.0.0", out=lambda line: None)
    return ws / "tpu-kernel-records-1.0.0"


@pytest.mark.parametrize("config, rows", [("benchmark", 28), ("correctness", 18), ("environment", 2)])
def test_load_dataset_on_the_staged_release(release, tmp_path, config, rows):
    ds = datasets.load_dataset(str(release), config, split="train", cache_dir=str(tmp_path / "cache"))
    assert ds.num_rows == rows and ds.features == tkr.FEATURES[config]
    assert sorted(set(ds["record_id"])) == [PUBLISHED, "synthetic-cpu"]


def test_default_config_is_benchmark(release, tmp_path):
    ds = datasets.load_dataset(str(release), split="train", cache_dir=str(tmp_path / "cache"))
    assert ds.features == tkr.FEATURES["benchmark"]


def test_staged_script_works_standalone_by_direct_builder_use(release, tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("staged_tpu_kernel_records", release / "tpu_kernel_records.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    builder = module.TpuKernelRecords(config_name="environment", cache_dir=str(tmp_path / "cache"))
    assert builder.info.license == "cc-by-nc-4.0" and "Laela Zorana" in builder.info.citation
    assert builder.info.homepage and builder.info.description
    builder.download_and_prepare()
    ds = builder.as_dataset(split="train")
    assert ds.info.license == "cc-by-nc-4.0"
    assert {r["record_id"]: r["interpret"] for r in ds} == {PUBLISHED: False, "synthetic-cpu": True}
    names = [c.name for c in module.TpuKernelRecords.BUILDER_CONFIGS]
    assert names == ["benchmark", "correctness", "environment"]
    assert module.TpuKernelRecords.DEFAULT_CONFIG_NAME == "benchmark"


def test_load_never_serves_a_stale_cache(tmp_path):
    ws = testing.workspace(tmp_path / "ws")
    build([ws / "runs" / PUBLISHED], ws / "data")
    cache = str(tmp_path / "cache")
    assert tkr.load("benchmark", data_dir=ws / "data", cache_dir=cache).num_rows == 20
    build([testing.write(ws / "runs", "synthetic-cpu")], ws / "data", allow_interpret=True)
    # Same data_dir, same cache: only the SHA256SUMS fingerprint tells the two states apart.
    assert tkr.load("benchmark", data_dir=ws / "data", cache_dir=cache).num_rows == 28


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
