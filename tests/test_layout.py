"""The package's rooms (issue 52): the sandbox knows nothing of attention, every contract's folder has the same
modules, no module is over 600 lines, and a bare worker serves nothing until its caller names a service."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tpu_kernel_records_tools.sandbox import sandbox

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "tpu_kernel_records_tools"
CONTRACT_MODULES = {"slots.py", "problems.py", "truth.py", "checks.py", "known_bad.py"}
MAX_LINES = 600


def _imported(path: Path) -> set[str]:
    """Every module ``path`` imports (relative imports resolved against the package), lazy ones included."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = parts[:len(parts) - node.level] if node.level else ()
            found.add(".".join([*base, *([node.module] if node.module else [])]))
    return found


def test_imported_resolves_relative_imports():
    assert _imported(PKG / "sandbox" / "isolation.py") >= {"tpu_kernel_records_tools.sandbox.errors"}


def test_the_sandbox_imports_nothing_that_knows_attention():
    for path in sorted((PKG / "sandbox").glob("*.py")):
        up = {m for m in _imported(path) if m.startswith(("tpu_kernel_records_tools.", "kernel_src"))
              and not m.startswith("tpu_kernel_records_tools.sandbox")}
        assert not up, f"{path.name} imports {sorted(up)}"


def test_every_contract_folder_has_the_same_modules():
    for name in ("dense", "paged"):
        have = {p.name for p in (PKG / "grading" / name).glob("*.py")}
        assert CONTRACT_MODULES <= have, f"grading/{name} lacks {sorted(CONTRACT_MODULES - have)}"


def test_no_module_is_over_600_lines():
    long = [f"{p.relative_to(ROOT)} {n}" for p in [*PKG.rglob("*.py"), *(ROOT / "kernel_src").rglob("*.py")]
            if (n := len(p.read_text().splitlines())) > MAX_LINES]
    assert not long, long


def test_a_service_that_is_not_module_colon_factory_is_refused():
    with pytest.raises(ValueError, match="module:factory"):
        sandbox.Sandbox(service="import os; os.system('x')")
    sandbox.Sandbox(service="pkg.module:Factory")


def test_a_bare_worker_says_hello_and_refuses_every_request():
    box = sandbox.Sandbox(memory_limit_gb=0)
    box.start()
    try:
        box.wait_ready(60)
        header, arrays = box.request({"op": "forward"}, timeout_s=60, reply_limit_bytes=1 << 10)
        assert header["ok"] is False and "unexpected request 'forward'" in header["error"] and arrays == []
    finally:
        box.close()
