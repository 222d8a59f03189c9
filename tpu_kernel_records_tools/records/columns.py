"""What each column of the release means, declared once beside ``records.schema`` (which declares its type).

``COLUMNS[config][name] = (unit, meaning, when null)``: the card's Data Fields tables are generated from
these (``builder.fields``), and a column of ``records.schema.FEATURES`` without an entry here fails the
build. ``—`` is "no unit" or "never null". Struct and list columns describe their members in the meaning.
"""

from __future__ import annotations

from .rawio import scorecard_features

NEVER = "never"
NOT_SUBMITTED = "not a submitted kernel's record"

_RECORD = {
    "record_id": ("—", "the record (one accepted run); its raw files are under `data/raw/<record_id>/`", NEVER),
    "source": ("—", "`measured` (this project's `measure` job), `submitted` (a kernel someone submitted), "
                    "`published-summary` (transcribed from a published card: medians only) or `grader-power` "
                    "(the grader's own power sweep, no kernel timed)", NEVER),
    "platform": ("—", "`tpu`, `gpu` or `cpu`: where the record was made", NEVER),
    "interpret": ("—", "true when Pallas ran in interpret mode on a CPU: those timings say nothing about kernel "
                       "speed", NEVER),
}
_SHAPE = {
    "batch": ("count", "batch size (a `ragged` case: its sequences)", "a published summary that does not state it"),
    "q_len": ("tokens", "query length (a `ragged` case: q's rows, all sequences' together, padded)",
              "a published summary that does not state it"),
    "kv_len": ("tokens", "key / value length (bottom-right causal: the last query sees every key; a `ragged` case: "
                         "its longest sequence's)", "a published summary that does not state it"),
    "num_q_heads": ("count", "query heads", "a published summary that does not state it"),
    "num_kv_heads": ("count", "key / value heads; query head `h` reads kv head `h // (num_q_heads // "
                              "num_kv_heads)`", "a published summary that does not state it"),
    "head_dim": ("count", "features per head", "a published summary that does not state it"),
}
_TIMING = "a published summary (it printed medians only)"
_NO_PEAK = "a published summary, or a device whose peak is not known"
_NO_PAIR = "the case is no pair's numerator (e.g. the XLA case itself)"
_NO_MASK = "not a `masks-*` case, or a record from before masks existed"
_NO_PAGED = "not a `paged-decode` or `ragged` case, or a record from before paged caches existed"
_NO_RAGGED = "not a `ragged` case, or a record from before the ragged scope existed"

BENCHMARK = {
    **_RECORD,
    "device_kind": ("—", "the device as JAX names it (e.g. `TPU v5 lite` on a v5e, `cpu`); a transcription keeps "
                         "the name its source printed (`TPU v5e`)", NEVER),
    "device_count": ("count", "devices visible to the run", NEVER),
    "profile": ("—", "the benchmark profile that chose the shapes: `cpu`, `tiny`, `tpu-v5e`, `gpu`, `h100` (a short "
                     "check on one NVIDIA H100); `published` for a transcription, `grader-power` for a grader-power "
                     "sweep (no shapes timed)", NEVER),
    "case_id": ("—", "the case, unique in its record, e.g. `attention-pallas-s2048`", NEVER),
    "scope": ("—", "what is timed: `softmax`, `attention`, `flash`, `sharded`, `model-fwd`, `model-fwd-bwd`, "
                   "`masks-fwd`, `masks-fwd-bwd`, `paged-decode` (one decode step over a paged KV cache), "
                   "`ragged` (one serving step: decode rows, prefill chunks and a whole prompt in one call over a "
                   "paged, possibly quantized cache)", NEVER),
    "implementation": ("—", "`xla` (the pure-JAX reference), `pallas`, `flash`, `flash-triton`, `cudnn`, "
                            "`submitted`, or `<impl>@<devices>` in the sharded scope; `paged-decode`: `paged-xla` "
                            "(gather-then-attend reference), `paged-pallas`, `paged-triton`, `jax-paged` (JAX's "
                            "`paged_attention`); `ragged`: `ragged-xla` (every row gathers its sequence's table, "
                            "then attends), `ragged-pallas`, `ragged-triton`, `jax-ragged` (JAX's "
                            "`ragged_paged_attention`)", NEVER),
    "graded_verdict": ("—", "the verdict of the scorecard(s) of the implementation this row timed (its "
                            "candidate: the submission, or the registry's `grading_name`, e.g. `reference` for "
                            "`xla`): `passed`. A run in which any timed kernel's scorecard failed, errored or is "
                            "missing is refused at build, so no accepted row says otherwise; filter on "
                            "`graded_verdict == \"passed\"` for graded kernels only",
                       "no scorecard of the record grades it: a published summary (its scorecard is the card's "
                       "transcribed claim), or an XLA reference or vendor kernel (cuDNN, "
                       "JAX's `paged_attention`) timed for comparison and not graded in its run"),
    "seq_len": ("tokens", "the sequence length the case is named by", NEVER),
    **_SHAPE,
    "dtype": ("—", "input dtype (`bfloat16` or `float32`); logits and statistics are fp32", NEVER),
    "causal": ("—", "bottom-right aligned causal mask", "a published summary that does not state it"),
    "padded": ("—", "whether `kv_lengths` padding was passed", "a published summary that does not state it"),
    "model": ("—", "scopes `masks-fwd` / `masks-fwd-bwd`: the model whose attention mask the case runs "
                   "(`mistral-7b`, `gemma-2-9b`, `gpt-oss-20b`, `packed`); `paged-decode`: the model whose heads "
                   "(and window) the decode step has (`llama-3-8b`, `mistral-7b`); `ragged`: the model whose heads "
                   "the serving step has (`llama-3-8b`, `qwen2.5-7b`); `-tiny` at the CPU profiles' sizes",
              "not a `masks-*`, `paged-decode` or `ragged` case, or a record from before them"),
    "window": ("tokens", "the sliding window `window_size` as `left` / `right`: key `j` is visible to the row at "
                         "position `p` iff `p - left <= j <= p + right` (a side null: unbounded); a model's "
                         "`sliding_window = W` is `left = W - 1, right = 0`",
               "not a `masks-*` or `paged-decode` case, or a record from before them, or no window"),
    "softcap": ("—", "the logit soft-cap: `s = softcap * tanh(s / softcap)` before masking",
                f"{_NO_MASK}, or no soft-cap"),
    "segments": ("count", "packed rows: documents per row, passed as segment ids (a query sees only keys of its "
                          "document)", f"{_NO_MASK}, or rows of one sequence (no segment ids)"),
    "sinks": ("—", "true: one sink logit per query head joins each row's softmax (its gradient is in the "
                   "backward)", f"{_NO_MASK}, or no sinks"),
    "page_size": ("tokens", "keys per page of the paged KV cache: key `j` of a sequence is slot `j % page_size` of "
                            "the page its table names at entry `j // page_size`", _NO_PAGED),
    "pages": ("count", "page-table entries per sequence (`kv_len / page_size` rounded up: the longest sequence's "
                       "pages; shorter ones use fewer)", _NO_PAGED),
    "pool_pages": ("count", "pages in the pool the tables point into (each sequence's pages distinct and in a "
                            "random order)", _NO_PAGED),
    "num_seqs": ("count", "sequences in the serving step: decode rows (one new row each), chunks of a prefill and "
                          "whole prompts, in one call (`batch` repeats it)", _NO_RAGGED),
    "q_rows": ("count", "the step's query rows, every sequence's new rows; `q_len` is q's first axis, these padded "
                        "to a multiple of 16 (padding rows are neither graded nor counted as work)", _NO_RAGGED),
    "kv_dtype": ("—", "the KV cache's dtype: `bfloat16` (q's), or `float8_e4m3fn` stored quantized", _NO_RAGGED),
    "quantized_kv": ("—", "true: the cache is stored quantized (`float8_e4m3fn` with `k_scale` 0.5 and `v_scale` "
                          "0.25: a key is `float32(stored) * k_scale`), the contract's `quantized_kv` feature, which "
                          "the timed kernel's scorecard then grades", _NO_RAGGED),
    "devices_used": ("count", "devices this case ran on", NEVER),
    "status": ("—", "`ok`, or `failed` (then `error` says why; an accepted record has only `ok`)", NEVER),
    "error": ("—", "why the case failed", "the case succeeded"),
    "warmups": ("count", "untimed calls before the samples", NEVER),
    "samples_per_case": ("count", "timed samples the profile asked for", NEVER),
    "num_samples": ("count", "length of `samples_ms` (0 for a published summary)", NEVER),
    "samples_ms": ("ms", "every synchronized steady-state sample, in order (each ends in "
                         "`block_until_ready()`)", "never (empty for a published summary)"),
    "transfer_ms": ("ms", "host-to-device transfer of the inputs", _TIMING),
    "lower_ms": ("ms", "lowering of the jitted function", _TIMING),
    "compile_ms": ("ms", "compilation, kept apart from the samples", _TIMING),
    "median_ms": ("ms", "median of the samples (as printed, for a published summary)", NEVER),
    "min_ms": ("ms", "fastest sample", _TIMING),
    "max_ms": ("ms", "slowest sample", _TIMING),
    "q1_ms": ("ms", "first quartile of the samples", _TIMING),
    "q3_ms": ("ms", "third quartile of the samples", _TIMING),
    "iqr_ms": ("ms", "`q3_ms - q1_ms`", _TIMING),
    "peak_memory_bytes": ("bytes", "the devices' peak memory in use so far in the run (a high-water mark of the "
                                   "process, not of this case alone)", "the backend does not report it, or a "
                                   "published summary"),
    "flops": ("FLOP", "useful floating-point operations of one call: `4 * num_q_heads * head_dim` per visible "
                      "(query, key) pair, so pairs hidden by the causal mask, padding, a window or segment ids "
                      "count nothing (derived from the mask exactly); backward 2.5x the forward",
              "a published summary"),
    "bytes_moved": ("bytes", "least bytes one call must move to and from device memory (every input read and "
                             "every output written once); `paged-decode`: the K/V actually read (each key a new "
                             "row sees, its K and V once) plus q and the output, derived from the case's lengths "
                             "exactly; `ragged` likewise, K and V at the cache's dtype (1 byte for "
                             "`float8_e4m3fn`), q and the output for the step's `q_rows`", "a published summary"),
    "tflops": ("TFLOP/s", "`flops / median`", "a published summary"),
    "gbps": ("GB/s", "`bytes_moved / median`", "a published summary"),
    "peak_flops_fraction": ("fraction", "`tflops` over the device's peak", _NO_PEAK),
    "peak_bandwidth_fraction": ("fraction", "`gbps` over the device's peak memory bandwidth", _NO_PEAK),
    "baseline_case_id": ("—", "the primary pair's baseline case (the XLA case where there is one)", _NO_PAIR),
    "ratio_to_baseline": ("ratio", "this case's median over the baseline's median: above 1 this case is slower",
                          _NO_PAIR),
    "ratio_ci_low": ("ratio", "lower end of the ratio's 95% percentile-bootstrap interval (seeded, recomputable "
                              "from the samples)", f"{_NO_PAIR}, or a published summary"),
    "ratio_ci_high": ("ratio", "upper end of that interval", f"{_NO_PAIR}, or a published summary"),
    "scaling_efficiency": ("fraction", "sharded scope: `t1 / (devices * tn)` from the medians; 1 is perfect "
                                       "strong scaling", "not a sharded pair"),
    "pairs": ("—", "every pair with this case on top: `baseline_case_id`, `ratio`, `ci_low`, `ci_high`, "
                   "`devices`, `scaling_efficiency` (the flat columns repeat the primary one)", "never (empty "
                                                                                                "list)"),
    "stablehlo": ("—", "path under the release of the case's gzipped StableHLO", "not captured (a published "
                                                                                  "summary)"),
    "stablehlo_tpu": ("—", "path of the case's gzipped TPU-lowered StableHLO (exported on a CPU)",
                      "no TPU lowering was made"),
    "compiled_tpu": ("—", "**predicted by the compiler, not measured**: XLA's cost and memory analysis of the "
                          "case's TPU program, each Pallas kernel's VMEM and declared cost, the bytes moved by the "
                          "ops around the kernels, and the path of the optimized HLO", "no TPU program, or no "
                          "libtpu at hand (`compiled_tpu_reason` says why)"),
    "compiled_tpu_reason": ("—", "why `compiled_tpu` is null", "`compiled_tpu` is set, or not applicable"),
    "program_sha256": ("—", "sha256 of the exported program that was timed (one the scorecard graded)",
                       NOT_SUBMITTED),
    "roofline_floor_ms": ("ms", "least time the case's FLOPs and bytes allow at the device's peak; a median "
                                "below it is refused", f"{NOT_SUBMITTED}, or the peak is not known"),
    "output_checks": ("—", "timed calls rerun after timing and judged against the float64 truth: `sample`, "
                           "`passed`, `detail`", NOT_SUBMITTED),
}

_CHECK = "a grader-power row (`row_kind = power`)"
_FEATURE_NAMES = ", ".join(f"`{name}`" for name in scorecard_features())
_POWER = "a check row (`row_kind = check`)"
CORRECTNESS = {
    **_RECORD,
    "seed": ("—", "seed of the rubric's inputs", "a published summary"),
    "row_kind": ("—", "`check`: one row per candidate x check; `power`: one row per candidate of a grader-power "
                      "sweep", NEVER),
    "candidate": ("—", "the graded candidate: a kernel, a correct variant, a known-bad one or a submission", NEVER),
    "kind": ("—", "`reference`, `kernel`, `correct-variant`, `known-bad` (must be rejected), `external` "
                  "(submitted) or `published`", NEVER),
    "measured": ("—", "this candidate is the record's measured kernel: every one of its checks must pass", NEVER),
    "candidate_passed": ("—", "the candidate passed every check", _CHECK),
    "score": ("points", "sum of `points` over the candidate's checks", _CHECK),
    "max_score": ("points", "sum of `max_points`", _CHECK),
    "candidate_error": ("—", "why the candidate could not be graded at all", "it was graded"),
    "isolation": ("—", "where the candidate's worker ran: `bubblewrap` (sandbox) or `process` (plain child "
                       "process)", f"{_CHECK}, or a run graded before it was recorded"),
    "memory_limit": ("—", "what bounded the memory of the candidate's worker: `cgroup` (a memory cgroup of its own, "
                          "counting memfds, tmpfs files and pipes too), `address-space` (an address-space limit "
                          "alone, where no cgroup could be made) or `none`", f"{_CHECK}, or a run graded before it "
                                                                             "was recorded"),
    "features": ("—", "the contract features the candidate declared and was graded on, on top of the base "
                      f"contract, in the contract's order ({_FEATURE_NAMES}), each by the check of its name; `[]`: "
                      "the base contract only", f"{_CHECK}, or a run graded before features existed (those "
                                                 "graded the base contract only)"),
    "programs": ("—", "sha256 of every exported program the grade could call", NOT_SUBMITTED),
    "contract": ("—", "the contract the candidate was graded on: `attention` (dense K/V) or `paged` "
                      "(`paged_attention` over a page table and a pool; its checks are named `paged-*`); a "
                      "scorecard that names none (graded before paged caches existed) was graded on `attention`; "
                      "a power row: the contract its candidate was swept on (sweeps before the paged built-ins "
                      "were swept graded `attention` only)", NEVER),
    "check": ("—", "the check's name (e.g. `causal-leak`, `gradients`); a published summary's rows keep its card's "
                   "own check names (e.g. `causal-mask`), not the rubric's", f"{_CHECK}, or a candidate that could "
                                                                          "not be loaded"),
    "passed": ("—", "the check passed", _CHECK),
    "points": ("points", "points earned: `max_points` when passed, else 0", _CHECK),
    "max_points": ("points", "the check's weight", _CHECK),
    "detail": ("—", "what the check did and found, in one paragraph; in a published summary's rows, the published "
                    "card's line naming what its check guards against (a passed check's line names the bug it "
                    "looked for, not one it found)", _CHECK),
    "error": ("relative", "the candidate's worst error against the float64 truth (or against an allowed "
                          "rounding's exact answer, where nearer)", f"{_CHECK}, or a check that is not numeric"),
    "tolerance": ("relative", "the bound `error` was held to", f"{_CHECK}, or a check that is not numeric"),
    "baseline_error": ("relative", "the contract-precision reference's error on the same inputs, or the "
                                   "per-query-head dK/dV rounding's where larger (the room the check left: "
                                   "compare with `error`)",
                       f"{_CHECK}, or not numeric"),
    "trials": ("count", "seeds the candidate was graded on", _POWER),
    "rejected": ("count", "trials whose scorecard did not pass", _POWER),
    "rejected_by": ("—", "per check (`check`, `count`): trials on which that check failed", _POWER),
    "expected": ("—", "`pass` (correct candidates), `reject` (known-bad) or `unknown`", _POWER),
    "intended_checks": ("—", "the checks built to catch this known-bad candidate's bug; `[]` for a candidate that is "
                             "not known-bad", _POWER),
    "rejected_by_intended": ("count", "trials on which at least one intended check failed", f"{_POWER}, or not "
                                                                                            "known-bad"),
    "power_detail": ("—", "per candidate: `seconds_per_trial`, `load_error`, `min_k_to_pass_tolerances` (the "
                          "least tolerance multiple k it needed to pass), per-comparison `calibration`, and any "
                          "other key of the sweep as `{name, json}`", _POWER),
    "power_settings": ("—", "the sweep's settings and totals (same on each of its rows): seeds, shapes, dtypes, "
                            "checks, tolerance policy (`k_forward`, `k_gradient`, `floor`), false rejects and "
                            "missed known-bad trials", _POWER),
}

_NOT_STATED = "a published summary that does not state it"
ENVIRONMENT = {
    **_RECORD,
    "created_utc": ("UTC time", "when the run started", _NOT_STATED),
    "profile": BENCHMARK["profile"],
    "device_kind": BENCHMARK["device_kind"],
    "device_count": BENCHMARK["device_count"],
    "expected_device_count": ("count", "devices the TPU slice must show (8 on a v5e-8); a TPU run with fewer is "
                                       "refused", "not a TPU record"),
    "devices_used": ("count", "most devices any case used", NEVER),
    "process_count": ("count", "JAX processes", NEVER),
    "jax": ("—", "JAX version", NEVER),
    "jaxlib": ("—", "jaxlib version", _NOT_STATED),
    "libtpu": ("—", "libtpu version", "not a TPU, or not stated"),
    "gpu_plugin": ("—", "JAX's CUDA plugin version", "not a GPU"),
    "python": ("—", "Python version", _NOT_STATED),
    "numpy": ("—", "NumPy version", _NOT_STATED),
    "os": ("—", "operating system", _NOT_STATED),
    "other_versions": ("—", "other packages' versions (`name`, `version`)", "never (empty list)"),
    "cpu_model": ("—", "the host's CPU", _NOT_STATED),
    "git_commit": ("—", "commit of the measuring code", "not run from a git checkout"),
    "kernel_src_sha256": ("—", "sha256 of `kernel_src/` as measured", _NOT_STATED),
    "env_vars": ("—", "allow-listed environment variables (`name`, `value`): `XLA_FLAGS`, `JAX_*`, `TPU_*`, ...",
                 "never (empty list)"),
    "bootstrap": ("—", "every JAX version tried before the run, in order: `jax`, `jaxlib`, `libtpu`, `outcome` "
                       "(`used`, `rejected`, `failed`), `error`", "never"),
    "notes": ("—", "free text: for a transcription, every field its source does not state", "no notes"),
    "measured_candidate": ("—", "the candidate whose checks must all pass for the record to be accepted; `none` in a "
                                "grader-power record (no kernel measured)", NEVER),
    "checks": ("count", "checks of the measured candidate (0 in a grader-power record: no kernel measured)", NEVER),
    "checks_passed": ("count", "of those, passed", NEVER),
    "submission_spec": ("—", "the submitted kernel as given, `file.py:function`", NOT_SUBMITTED),
    "submission_file_sha256": ("—", "sha256 of the submitted file", NOT_SUBMITTED),
    "cases": ("count", "benchmark cases (0 in a grader-power record)", NEVER),
    "cases_ok": ("count", "of those, with status `ok`", NEVER),
    "warmups": BENCHMARK["warmups"],
    "samples_per_case": BENCHMARK["samples_per_case"],
    "raw_files": ("—", "every raw file of the run (`path`, `sha256`), as its manifest lists them", NEVER),
}

COLUMNS: dict[str, dict[str, tuple[str, str, str]]] = {
    "benchmark": BENCHMARK, "correctness": CORRECTNESS, "environment": ENVIRONMENT}

_JSON_OTHER = "any other key of the sweep's document, by `name`, with its value as `json` text"
# The members of the struct columns a reader digs into, ``MEMBERS[config][column][path] = (unit, meaning)``;
# ``path`` is dotted, ``[]`` stepping into a list's items. The card's nested-field tables are generated from these
# (``builder.fields``), and a member of ``records.schema.FEATURES`` without an entry fails the build.
MEMBERS: dict[str, dict[str, dict[str, tuple[str, str]]]] = {
    "benchmark": {"compiled_tpu": {
        "source": ("—", "how the program was compiled (by the run's TPU backend, or for a TPU v5e by libtpu without a "
                        "chip): a prediction, not a measurement"),
        "device_kind": ("—", "the TPU the compiler planned for"),
        "jax": ("—", "JAX version of the compile"),
        "libtpu": ("—", "libtpu version of the compile"),
        "flops": ("FLOP", "XLA's cost analysis of the program (each Pallas kernel counts what it declares)"),
        "bytes_accessed": ("bytes", "XLA's cost analysis: bytes the program reads and writes"),
        "argument_bytes": ("bytes", "XLA's memory analysis: the arguments"),
        "output_bytes": ("bytes", "XLA's memory analysis: the outputs"),
        "temp_bytes": ("bytes", "XLA's memory analysis: temporaries"),
        "generated_code_bytes": ("bytes", "XLA's memory analysis: the generated code"),
        "vmem_bytes": ("bytes", "the most VMEM any one Pallas kernel of the program reserves"),
        "outside_bytes": ("bytes", "bytes read and written by the data-moving ops around the Pallas kernels"),
        "outside_ops": ("—", "the opcodes of those ops"),
        "kernels": ("—", "each Pallas TPU kernel of the program"),
        "kernels[].name": ("—", "the kernel's instruction name in the optimized HLO"),
        "kernels[].vmem_bytes": ("bytes", "VMEM the kernel reserves (null: none stated)"),
        "kernels[].result_bytes": ("bytes", "bytes of the kernel's results"),
        "kernels[].declared_flops": ("FLOP", "FLOPs the kernel's `pl.CostEstimate` declares (null: none declared)"),
        "kernels[].declared_bytes": ("bytes", "bytes its `pl.CostEstimate` declares (null: none declared)"),
        "hlo": ("—", "path under the release of the program's gzipped optimized HLO (the builder re-derives the "
                     "fields above from it)"),
    }},
    "correctness": {
        "power_detail": {
            "seconds_per_trial": ("s", "seconds per trial of this candidate (the time its grades took)"),
            "load_error": ("—", "why the candidate could not be loaded (null: it loaded)"),
            "min_k_to_pass_tolerances": ("—", "the least tolerance multiple k with which every comparison of its "
                                              "trials would pass"),
            "calibration": ("—", "per comparison group (`forward` or `gradient` / dtype)"),
            "calibration[].key": ("—", "the group, e.g. `forward/bfloat16`"),
            "calibration[].max_ratio": ("ratio", "the largest error / tolerance ratio seen (above 1: a failed "
                                                 "comparison)"),
            "calibration[].needed_k": ("—", "the least k that passes every comparison of the group, at the policy's "
                                            "floor"),
            "calibration[].needed_floor_eps": ("float32 eps", "the least floor, in units of `eps(float32) * max(1, "
                                                              "L)`, that passes them at the policy's k"),
            "other": ("—", _JSON_OTHER),
            "other[].name": ("—", "the key"),
            "other[].json": ("—", "its value as JSON"),
        },
        "power_settings": {
            "seeds": ("count", "seeds swept"),
            "first_seed": ("—", "the first of them (the others follow it)"),
            "shapes": ("—", "the dense problems' shapes (the paged ones are in `other` as `paged_shapes`)"),
            "shapes[].name": ("—", "slot and seed, e.g. `long@0`"),
            "shapes[].batch": ("count", "batch size"),
            "shapes[].q_len": ("tokens", "query length"),
            "shapes[].kv_len": ("tokens", "key / value length"),
            "shapes[].num_q_heads": ("count", "query heads"),
            "shapes[].num_kv_heads": ("count", "key / value heads"),
            "shapes[].head_dim": ("count", "features per head"),
            "dtypes": ("—", "input dtypes drawn"),
            "checks": ("—", "the dense rubric's checks (the paged ones are in `other` as `paged_checks`)"),
            "policy": ("—", "the tolerance policy the sweep judged with"),
            "policy.k_forward": ("—", "k for the output"),
            "policy.k_gradient": ("—", "k for dQ, dK, dV"),
            "policy.floor": ("relative", "the floor at `L <= 1`: `floor_float32_eps_multiple * eps(float32)`"),
            "policy.floor_float32_eps_multiple": ("float32 eps", "the floor in units of `eps(float32)`"),
            "policy.rule": ("—", "the rule in words"),
            "false_rejects": ("count", "trials of correct candidates rejected"),
            "correct_trials": ("count", "trials of correct candidates"),
            "missed_bad": ("count", "trials of known-bad candidates not rejected"),
            "bad_trials": ("count", "trials of known-bad candidates"),
            "other": ("—", _JSON_OTHER + " (e.g. `level`, `by_contract`, `paged_shapes`, `paged_checks`)"),
            "other[].name": ("—", "the key"),
            "other[].json": ("—", "its value as JSON"),
        },
    },
}
