"""Candidates the rubric grades: every contract's built-ins (``BUILTIN``, ``PAGED_BUILTIN``) and any user's.

:func:`resolve` turns a built-in name, ``path/to/file.py:function`` or ``package.module:function`` into a
:class:`Candidate`. Loading is lazy: a kernel that does not import yet, or a file that does not exist, fails
in :meth:`Candidate.load` and the rubric turns that into a scorecard with the load error.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.util
import os
import pickle
import sys
from pathlib import Path
from typing import Callable

from ..sandbox import candidate_files
from ..grading.candidate import KINDS, Attention, Candidate, CandidateLoadError, CandidateSpecError  # noqa: F401
from ..sandbox.cpu_jit import CPU_COMPILE_OPTIONS, cpu_compile_options, jit_cpu  # noqa: F401  (re-exported)
from ..grading.contracts import CONTRACTS
from ..grading.dense.known_bad import BUILTIN, jit_contract, reference  # noqa: F401  (re-exported)
from ..grading.paged.known_bad import PAGED_BUILTIN  # noqa: F401  (re-exported)


def builtins() -> dict[str, Candidate]:
    """Every contract's built-ins by name (``grading.contracts.CONTRACTS``, in its order)."""
    return {name: c for contract in CONTRACTS.values() for name, c in contract.builtins.items()}


def is_builtin(candidate) -> bool:
    """Whether ``candidate`` is one of the project's own built-ins (of any contract)."""
    return builtins().get(getattr(candidate, "name", None)) is candidate


def names_a_file(target: str) -> bool:
    """Whether a spec's target (before ``:function``) names a source file rather than a module path."""
    return target.endswith(".py") or "/" in target or "\\" in target


def _load_external(spec: str, target: str, function: str) -> Callable[[], Attention]:
    def load() -> Attention:
        if names_a_file(target):
            path = Path(target).expanduser().resolve()
            if not path.is_file():
                raise CandidateLoadError(f"candidate file {target} does not exist")
            module_name = "rubric_candidate_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
            module_spec = importlib.util.spec_from_file_location(module_name, path)
            if module_spec is None or module_spec.loader is None:
                raise CandidateLoadError(f"cannot import {target} as Python source")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[module_name] = module
            try:
                module_spec.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(module_name, None)
                raise
        else:
            module = importlib.import_module(target)
        if not hasattr(module, function):
            raise CandidateLoadError(f"{target} has no attribute {function!r}")
        return getattr(module, function)
    return load


def _refuse_links(check: Callable[[], None]) -> None:
    """``check()`` (a ``sandbox.candidate_files`` check), its refusal as a :class:`CandidateSpecError`."""
    try:
        check()
    except candidate_files.LinkRefused as e:
        raise CandidateSpecError(str(e)) from None


def resolve(spec: str | Candidate, root: str | os.PathLike | None = None) -> Candidate:
    """A built-in name (of any contract: :func:`builtins`), ``path/to/file.py:function`` or
    ``package.module:function`` as a Candidate.

    ``root``: the folder of a kernel that spans several files (its modules import each other from it); a
    file spec must lie inside it. Raises :class:`CandidateSpecError` for a spec of neither form, or a
    root that is not a folder or does not hold the file (the file or module itself is only imported by
    :meth:`Candidate.load`).
    """
    if isinstance(spec, Candidate):
        return spec
    spec = str(spec).strip()
    every = builtins()
    if spec in every:
        return every[spec]
    if ":" not in spec:
        raise CandidateSpecError(
            f"unknown candidate {spec!r}: use a built-in ({', '.join(every)}), "
            f"path/to/file.py:function or package.module:function")
    target, _, function = spec.rpartition(":")
    if not target or not function.isidentifier():
        raise CandidateSpecError(f"bad candidate spec {spec!r}: expected path/to/file.py:function "
                                 f"or package.module:function")
    if not names_a_file(target) and \
            not all(part.isidentifier() for part in target.split(".")):
        raise CandidateSpecError(f"bad candidate spec {spec!r}: {target!r} is neither a .py file nor a module path")
    if root is not None:
        root = os.path.realpath(os.path.expanduser(root))
        if not os.path.isdir(root):
            raise CandidateSpecError(f"candidate folder {root} is not a folder")
        inside = os.path.realpath(os.path.expanduser(target)).startswith(root.rstrip("/") + "/")
        if names_a_file(target) and not inside:
            raise CandidateSpecError(f"candidate file {target} is not inside the candidate folder {root}")
        _refuse_links(lambda: candidate_files.check_folder(root))
    if names_a_file(target) and os.path.lexists(os.path.expanduser(target)):  # a missing file fails at load
        _refuse_links(lambda: candidate_files.check_file(os.path.expanduser(target), target))
    return Candidate(spec, "external", f"External candidate {spec}.", _load_external(spec, target, function),
                     root=root)


def load_request(candidate) -> dict:
    """The worker's ``load`` header for a candidate: its spec when it has one (built-in name,
    ``/abs/file.py:function``, ``module:function``), else its function pickled by reference (a
    programmatic ``Candidate``; its loader runs here, in the caller's process, which trusts it)."""
    if isinstance(candidate, str):
        candidate = resolve(candidate)
    assert isinstance(candidate, Candidate)
    if is_builtin(candidate):
        return {"op": "load", "spec": candidate.name}
    if candidate.kind == "external":
        try:
            spec_form = resolve(candidate.name)
        except CandidateSpecError:
            spec_form = None
        if spec_form is not None and spec_form.doc == candidate.doc:
            target, _, function = candidate.name.rpartition(":")
            if names_a_file(target):
                target = str(os.path.abspath(os.path.expanduser(target)))
                if not os.path.isfile(target):
                    raise CandidateLoadError(f"candidate file {candidate.name.rpartition(':')[0]} does not exist")
            return {"op": "load", "spec": f"{target}:{function}"}
    fn = candidate.load()
    try:
        return {"op": "load", "pickled": base64.b64encode(pickle.dumps(fn)).decode()}
    except Exception as e:
        raise CandidateLoadError(f"cannot hand {candidate.name!r} to a worker process ({type(e).__name__}: {e}); "
                                 f"give it as path/to/file.py:function") from None
