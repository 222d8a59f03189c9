"""The measuring process's side of a submitted kernel's export: one sandboxed worker (``sandbox.sandbox``
through ``grading.runner``) loads the candidate and answers the ``export`` op with ``grading.export``'s
programs; its failures, hangs and exits become one-line ``ProgramRefused`` errors."""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from ..grading.export import EXPORT_LIMIT_S, PROGRAM_LIMIT_BYTES, ProgramRefused, Signature, _one_line


def export_candidate(spec: str, signatures: Iterable[Signature], *, platform: str, isolation: str = "auto",
                     time_limit_s: float = EXPORT_LIMIT_S, root: str | None = None) -> dict[str, bytes]:
    """Export ``spec`` (``file.py:fn`` or ``module:fn``; ``root``: the folder of a kernel of several
    files) at every signature in a sandboxed worker, under the default memory limit (its cgroup where
    one can be had, ``sandbox.memcg``); returns signature key -> serialized program. Raises
    :class:`ProgramRefused` with one line."""
    sigs = list(signatures)
    return export_declared(spec, lambda _features: sigs, platform=platform, isolation=isolation,
                           time_limit_s=time_limit_s, root=root)[1]


def export_declared(spec: str, signatures_for: Callable[[tuple[str, ...]], Iterable[Signature]], *, platform: str,
                    isolation: str = "auto", time_limit_s: float = EXPORT_LIMIT_S,
                    root: str | None = None) -> tuple[tuple[str, ...], dict[str, bytes]]:
    """``export_candidate`` at the signatures ``signatures_for(features)`` gives for the features the
    loaded candidate declares (``kernel_src.contract.declared_features``, read in its worker); returns
    ``(features, programs by signature key)``."""
    from ..sandbox import isolation as isolations
    from ..grading.candidates import BUILTIN, CandidateSpecError, is_builtin, resolve
    from ..grading.runner import Runner
    from ..sandbox.sandbox import Expired, WorkerGone
    from ..sandbox.worker import ProtocolError

    try:
        cand = resolve(spec, root=root)
    except CandidateSpecError as e:
        raise ProgramRefused(str(e)) from None
    if cand.name in BUILTIN:
        raise ProgramRefused(f"{spec!r} is a built-in candidate; submit a file.py:function or module:function")
    try:
        where = isolations.choose(isolation, is_builtin(cand))
    except isolations.IsolationUnavailable as e:
        raise ProgramRefused(str(e)) from None
    runner = Runner(cand, time_limit_s=time_limit_s, isolation=where)
    try:
        error = runner.start()
        if error is not None:
            raise ProgramRefused(f"the candidate could not be loaded for export: {error}")
        sigs = list(dict.fromkeys(signatures_for(runner.features)))
        try:
            reply, arrays = runner.sandbox.request(
                {"op": "export", "platform": platform, "signatures": [s.to_dict() for s in sigs]},
                timeout_s=time_limit_s, reply_limit_bytes=PROGRAM_LIMIT_BYTES)
        except Expired:
            raise ProgramRefused(f"the export ran past its time limit ({time_limit_s:g} s); the exporter "
                                 f"and everything it started were killed") from None
        except WorkerGone as e:
            raise ProgramRefused(f"the exporter's worker process {e} during the export") from None
        except ProtocolError as e:
            raise ProgramRefused(f"the exporter sent a malformed reply ({str(e)[:200]})") from None
        if not reply.get("ok"):
            raise ProgramRefused(_one_line(str(reply.get("error", "the export failed"))))
        if len(arrays) != len(sigs) or any(a.dtype != np.uint8 or a.ndim != 1 for a in arrays):
            raise ProgramRefused(f"the exporter returned {len(arrays)} programs for {len(sigs)} signatures")
        return runner.features, {sig.key: a.tobytes() for sig, a in zip(sigs, arrays)}
    finally:
        runner.close()
