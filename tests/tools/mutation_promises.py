"""The promises README.md and docs/ make, each pinned by a planted bug that breaks it.

``PROMISES``: (doc file, a quote of the promise, the id of a mutation that breaks it), one row per
mutation (a promise broken by several has several rows). tests/tools/test_mutation_promises.py checks
that each quote is still in its file (whitespace aside) and each id is in mutation_check's list, so a
promise edited out of the docs, or an entry removed from the list, fails the suite at once.

``PROMISE_MUTATIONS``: the entries written for promises that no earlier entry broke, as the fields of
``mutation_check.Mutation`` (id, "module:qualname", old, new, tests, bug). They are plain tuples, so this
module imports nothing back: mutation_check appends them to its ``MUTATIONS`` whether it runs as a
script or is imported.
"""

from __future__ import annotations

MutationFields = tuple[str, str, str, str, tuple[str, ...], str]

SERVER_TEST = "tests/serve/api/test_server.py"
HARDENING_TEST = "tests/serve/api/test_server_hardening.py"
GUARD_TEST = "tests/serve/api/test_http_guard_middleware.py"
CACHE_TEST = "tests/serve/api/test_service_export_cache.py"
TUNING_TEST = "tests/ldlm/training/test_grid_search.py"
VERIFY_TEST = "tests/export/layernorm/test_verify.py"
QUANTIZE_TEST = "tests/export/test_quantize.py"

PROMISE_MUTATIONS: tuple[MutationFields, ...] = (
    # --- binding, auth and the HTTP guard ---------------------------------------------------------
    (
        "settings-bind-any-address",
        "ldlm.serve.api.service:ServerSettings",
        'host: str = "127.0.0.1"',
        'host: str = "0.0.0.0"',
        (f"{SERVER_TEST}::test_default_bind_is_loopback",),
        "a server started from Python or Ray Serve without a host listens on every interface",
    ),
    (
        "cli-serve-binds-any-address",
        "ldlm.cli.serving:add_commands",
        'p.add_argument("--host", default="127.0.0.1"',
        'p.add_argument("--host", default="0.0.0.0"',
        ("tests/ldlm/cli/test_serving_defaults.py",),
        "ldlm serve without --host listens on every interface",
    ),
    (
        "bearer-never-compared",
        "ldlm.serve.api.http_guard:GuardMiddleware.__call__",
        "if not hmac.compare_digest(given, self.expected_auth):",
        "if False:",
        (f"{GUARD_TEST}::test_bearer_key_guards_every_path_but_health",),
        "a server with LDLM_API_KEY answers every request, with any key or none",
    ),
    (
        "metrics-open-without-key",
        "ldlm.serve.api.http_guard:GuardMiddleware.OPEN_PATHS",
        'frozenset({"/", "/docs", "/openapi.json", "/health", "/version"})',
        'frozenset({"/", "/docs", "/openapi.json", "/health", "/version", "/metrics"})',
        (f"{GUARD_TEST}::test_bearer_key_guards_every_path_but_health",),
        "/metrics tells anyone about the served model though a key is set",
    ),
    (
        "api-key-printed",
        "ldlm.serve.api.server:_serve",
        """auth = ' -H "Authorization: Bearer $LDLM_API_KEY"' if settings.api_key else \"\"""",
        """auth = f' -H "Authorization: Bearer {settings.api_key}"' if settings.api_key else \"\"""",
        (f"{HARDENING_TEST}::test_key_never_printed_and_openapi_typed",),
        "the printed curl carries the API key into terminals and logs",
    ),
    (
        "unhandled-error-leaks-its-message",
        "ldlm.serve.api.http_guard:GuardMiddleware.__call__",
        'message = f"internal error ({type(error).__name__}); request id {request_id}"',
        'message = f"internal error ({error!r}); request id {request_id}"',
        (f"{GUARD_TEST}::test_errors_map_to_statuses_and_one_shape",),
        "a 500 tells the client the internals its error message holds",
    ),
    (
        "request-id-not-echoed",
        "ldlm.serve.api.http_guard:GuardMiddleware.__call__",
        'request_id = headers.get("x-request-id") or uuid.uuid4().hex',
        "request_id = uuid.uuid4().hex",
        (f"{GUARD_TEST}::test_errors_map_to_statuses_and_one_shape",),
        "a client's X-Request-Id is replaced: its answer and the log line cannot be matched to it",
    ),
    (
        "timeout-answered-500",
        "ldlm.serve.api.errors:error_status",
        "return 504, str(error), {}",
        "return 500, str(error), {}",
        (f"{GUARD_TEST}::test_error_shapes",),
        "a request past --timeout-s is answered as an internal error, not 504",
    ),
    (
        "body-timeout-not-408",
        "ldlm.serve.api.http_guard:read_body",
        'raise HTTPError(408, f"the request body',
        'raise HTTPError(400, f"the request body',
        (f"{GUARD_TEST}::test_read_body_edges",),
        "a body that never arrives is answered 400, which a client must not retry, not 408",
    ),
    (
        "kserve-request-samples-uncapped",
        "ldlm.serve.api.routes.kserve:check_infer_inputs",
        "if array.ndim >= 1 and array.shape[0] > settings.max_request_samples:",
        "if False:",
        (f"{HARDENING_TEST}::test_huge_batch_is_refused_naming_the_limit",),
        "a /v2 infer of 20000 samples is not refused by --max-request-samples",
    ),
    (
        "kserve-request-tokens-uncapped",
        "ldlm.serve.api.routes.kserve:check_infer_inputs",
        "if tokens > settings.max_request_tokens:",
        "if False:",
        (f"{HARDENING_TEST}::test_huge_batch_is_refused_naming_the_limit",),
        "a /v2 infer of 800 tokens runs on a server capped at 512 (--max-request-tokens)",
    ),
    (
        "oldest-idle-connection-kept",
        "ldlm.serve.api.http_guard:GuardedH11Protocol._shed_idle",
        "oldest = min(idle, key=lambda c: c.opened_at)",
        "oldest = max(idle, key=lambda c: c.opened_at)",
        (f"{HARDENING_TEST}::test_idle_connections_are_shed_so_clients_are_served",),
        "past --max-connections the newest idle connection is closed, so idle clients hold the oldest forever",
    ),
    (
        "busy-connections-unbounded",
        "ldlm.serve.api.http_guard:GuardedH11Protocol.connection_made",
        "if len(self.connections) > self.max_connections and self._open_connections() > self.max_connections and not self._shed_idle():",
        "if False:",
        (f"{HARDENING_TEST}::test_all_busy_connections_give_503_with_retry_after_and_json",),
        "connections past --max-connections are all held open: no 503, no shedding",
    ),
    # --- the server's process, log and sessions -----------------------------------------------------
    (
        "sigterm-kills-in-flight",
        "ldlm.serve.api.server:GracefulServer.capture_signals",
        "for sig in (signal.SIGINT, signal.SIGTERM)",
        "for sig in (signal.SIGINT,)",
        (f"{SERVER_TEST}::test_graceful_shutdown_finishes_in_flight_requests",),
        "SIGTERM kills the server with requests in flight",
    ),
    (
        "log-level-ignored",
        "ldlm.serve.api.server:json_log",
        "log.setLevel(level.upper())",
        'log.setLevel("DEBUG")',
        ("tests/serve/api/test_server_log.py::test_serve_logs_json_lines_while_it_serves_and_leaves_the_logger_as_it_was",),
        "--log-level warning still logs every request line (and debug lines besides)",
    ),
    (
        "served-arena-kept",
        "ldlm.serve.api.service:LDLMService._open_graphs",
        "memory_arena=False,",
        "memory_arena=True,",
        (f"{HARDENING_TEST}::test_served_sessions_give_peak_memory_back",),
        "one large request pins its peak memory for the server's life (ONNX Runtime's CPU arena)",
    ),
    # --- the export cache -----------------------------------------------------------------------------
    (
        "export-cache-entry-unverified",
        "ldlm.serve.api.export_cache:entry_problem",
        "check_artifacts(entry, manifest)",
        "None",
        (f"{CACHE_TEST}::test_a_tampered_cached_file_is_exported_again",),
        "a cached export whose graph was edited on disk is served",
    ),
    (
        "export-cache-other-weights-served",
        "ldlm.serve.api.export_cache:entry_problem",
        'if manifest.get("checkpoint_weights_sha256") != weights:',
        "if False:",
        (f"{CACHE_TEST}::test_an_entry_whose_manifest_names_other_weights_is_not_served",),
        "a cache entry made from other weights is served as this checkpoint's",
    ),
    (
        "export-cache-unlocked",
        "ldlm.serve.api.export_cache:_locked",
        "fcntl.flock(handle, fcntl.LOCK_EX)",
        "None",
        (f"{CACHE_TEST}::test_two_servers_starting_at_once_export_once",),
        "two servers starting at once both export the checkpoint into the same entry",
    ),
    (
        "export-key-drops-quantize",
        "ldlm.serve.api.export_cache:export_key",
        '**({"quantize": quantize} if quantize is not None else {}),',
        "**{},",
        ("tests/serve/api/test_export_cache_key.py",),
        "ldlm serve CKPT --precision int8 reuses the cached export made without the int8 variants",
    ),
    # --- request ranges ---------------------------------------------------------------------------------
    (
        "prior-temperature-above-one-accepted",
        "ldlm.limits:PRIOR_TEMPERATURE",
        "number(0, 1, low_open=True)",
        "number(0, 2, low_open=True)",
        ("tests/ldlm/sampling/test_loop_prior_temperature.py::test_a_bad_tau_is_refused_naming_it",),
        "a prior temperature of 1.5 runs: samples start wider than the denoiser was trained from",
    ),
    (
        "logprobs-above-five-accepted",
        "ldlm.limits:MAX_TOP_LOGPROBS",
        "MAX_TOP_LOGPROBS = 5",
        "MAX_TOP_LOGPROBS = 6",
        ("tests/serve/api/routes/test_openai.py::test_decoding_parameters_out_of_range_are_refused_in_openai_shape",),
        "logprobs=6 is accepted, past OpenAI's legacy range 0..5",
    ),
    (
        "openai-best-of-ignored",
        "ldlm.serve.api.openai_schemas:UNSUPPORTED",
        '"best_of": ((None, 1),',
        '"best_of": ((None, 1, 2),',
        ("tests/serve/api/routes/test_openai.py::test_decoding_parameters_out_of_range_are_refused_in_openai_shape",),
        "best_of=2 is silently ignored instead of refused",
    ),
    # --- scheduling and prompts -------------------------------------------------------------------------
    (
        "short-request-waits-behind-long",
        "ldlm.serve.runtime.policy:LeastWorkFirst.select",
        "key=lambda r: (self.priority(r, now), r.order)",
        "key=lambda r: r.order",
        ("tests/serve/runtime/test_scheduler_fairness.py::test_a_short_request_takes_a_slot_at_the_next_step_and_the_long_one_resumes",),
        "a one-step request waits for a long one to finish (first come, first served)",
    ),
    (
        "long-request-starved",
        "ldlm.serve.runtime.policy:SchedulingPolicy.priority",
        "return left - max(0.0, waited - grace)",
        "return left",
        ("tests/serve/runtime/test_scheduler_fairness.py::test_a_long_request_is_not_starved_by_a_stream_of_short_ones",),
        "a long request never runs while short ones keep arriving (no aging)",
    ),
    (
        "prior-temperature-config-ignored",
        "ldlm.model.config:LDLMConfig.prior_temperature_for",
        "return self.effective_prior_temperature if requested is None else requested",
        "return 1.0 if requested is None else requested",
        ("tests/ldlm/sampling/test_loop_prior_temperature.py::test_tau_comes_from_the_request_else_the_config_else_1",),
        "a checkpoint whose config sets a prior temperature samples at 1 unless each request names it",
    ),
    (
        "prompt-not-kept-verbatim",
        "ldlm.pipeline:LDLMPipeline.generate",
        "return result if ids is None else self.keep_prompt(result, ids)",
        "return result",
        ("tests/ldlm/sampling/test_loop.py::test_generate_with_a_prompt_keeps_the_prompts_latents",),
        "a prompted sample starts with what the decoder makes of the prompt's latents, not the prompt",
    ),
    # --- tuned step grids -------------------------------------------------------------------------------
    (
        "tuned-grids-of-other-weights-loaded",
        "ldlm.sampling.tuned_grids:load_schedules",
        "if expected is not None and schedules.weights_sha256 != expected:",
        "if False:",
        (f"{TUNING_TEST}::test_schedules_of_other_weights_are_refused_naming_both_hashes",),
        "grids tuned for other weights become this checkpoint's defaults",
    ),
    (
        "schedules-grids-unchecked",
        "ldlm.sampling.tuned_grids:TunedSchedules.check",
        'check_times(g.times, g.steps, self.t_min, f"{where}: the {g.sampler} grid of {g.steps} steps")',
        "pass",
        (f"{TUNING_TEST}::test_a_grid_edited_by_hand_is_refused_naming_what_is_wrong",),
        "a schedules.json edited into a grid the samplers cannot run is loaded",
    ),
    (
        "default-steps-not-the-fewest",
        "ldlm.training.grid_search:schedules_of",
        "if g.sampler not in defaults and matches_ddim50(g):",
        "if matches_ddim50(g):",
        ("tests/ldlm/training/test_grid_search_defaults.py",),
        "the default step count is the most tuned steps that match DDIM@50, not the fewest",
    ),
    (
        "default-matches-ddim50-on-error-alone",
        "ldlm.training.grid_search:matches_ddim50",
        'ours[n]["error"] <= ddim[n]["error"] and ours[n]["tokens"] >= ddim[n]["tokens"]',
        'ours[n]["error"] <= ddim[n]["error"]',
        ("tests/ldlm/training/test_grid_search_defaults.py",),
        "a grid with fewer of DDIM@50's tokens becomes the default",
    ),
    (
        "default-matches-ddim50-at-one-length",
        "ldlm.training.grid_search:matches_ddim50",
        "return all(",
        "return any(",
        ("tests/ldlm/training/test_grid_search_defaults.py",),
        "a grid as good as DDIM@50 at one held-out length only becomes the default",
    ),
    # --- export, verification, engines ------------------------------------------------------------------
    (
        "failed-write-leaves-its-temporary-directory",
        "ldlm.files:atomic_directory",
        "shutil.rmtree(tmp, ignore_errors=True)",
        "None",
        ("tests/ldlm/test_files_atomic_directory.py",),
        "a failed export, build or import leaves its half-written directory beside OUT",
    ),
    (
        "force-removes-before-the-work",
        "ldlm.files:atomic_directory",
        "    refuse_existing(out, overwrite, writer=writer)\n",
        "    refuse_existing(out, overwrite, writer=writer)\n    shutil.rmtree(out, ignore_errors=True)\n",
        ("tests/ldlm/test_files_atomic_directory.py",),
        "a --force replace that fails halfway has already deleted the earlier output",
    ),
    (
        "verify-eps-unchecked",
        "ldlm.export.layernorm.verify:_check_node",
        "if not eps_matches(eps, spec.eps):",
        "if False:",
        (f"{VERIFY_TEST}::test_changed_eps_is_rejected",),
        "a LayerNormalization at another eps than its module's passes verification",
    ),
    (
        "eps-compared-as-float64",
        "ldlm.export.layernorm.verify:eps_matches",
        "np.float32(eps) == np.float32(module_eps)",
        "eps == module_eps",
        ("tests/export/layernorm/test_verify_values.py::test_eps_compared_as_float32_per_node",),
        "every exported LayerNorm fails verification: 1e-5 is 9.99999975e-06 as an ONNX attribute",
    ),
    (
        "verify-decomposed-not-looked-for",
        "ldlm.export.layernorm.verify:verify_onnx",
        "problems += find_decomposed_layer_norms(model.graph)",
        "problems += []",
        (f"{VERIFY_TEST}::test_decomposed_layer_norm_is_rejected",),
        "a LayerNorm decomposed into ReduceMean, Sub, Pow... passes verification",
    ),
    (
        "verify-checker-skipped",
        "ldlm.export.layernorm.verify:verify_onnx",
        "onnx.checker.check_model(str(path), full_check=True)",
        "None",
        (f"{VERIFY_TEST}::test_checker_failure_and_unreadable_file_are_reported",),
        "a graph that fails onnx.checker's full check passes verification",
    ),
    (
        "network-eps-unchecked",
        "ldlm.export.layernorm.trt_network:check_network_layer_norms",
        "if not eps_matches(layer.epsilon, spec.eps):",
        "if False:",
        ("tests/export/layernorm/test_trt_network.py::test_each_network_rule_is_enforced",),
        "an engine whose INormalizationLayer runs at another eps is built",
    ),
    (
        "layernorm-lowered-to-half",
        "ldlm.export.precision:cast_graph",
        "is_low = index not in keep and node.op_type in POLYMORPHIC_OPS and _reads_float(node, types)",
        'is_low = (index not in keep and node.op_type in POLYMORPHIC_OPS or node.op_type == "LayerNormalization") and _reads_float(node, types)',
        ("tests/export/test_precision_values.py::test_lowered_graph_keeps_layer_norm_fp32_and_rounds_matmul_weights",),
        "fp16 and bf16 engines compute every LayerNorm in half precision",
    ),
    (
        "plan-from-another-tensorrt-loaded",
        "ldlm.serve.runtime.trt_runtime:check_plan_manifest",
        'if manifest.get("flavor") != flavor.name or manifest.get("trt_version") != flavor.version:',
        'if manifest.get("flavor") != flavor.name:',
        ("tests/export/test_engine_builder.py::test_plan_from_another_version_or_gpu_is_refused",),
        "a plan built by another TensorRT version is loaded, and fails or misbehaves inside TensorRT",
    ),
    (
        "plan-from-another-gpu-loaded",
        "ldlm.serve.runtime.trt_runtime:check_plan_manifest",
        "if not flavor.is_rtx and built_cc is not None and built_cc != gpu.compute_capability:",
        "if False:",
        ("tests/export/test_engine_builder.py::test_plan_from_another_version_or_gpu_is_refused",),
        "an NVIDIA TensorRT plan built for another GPU is loaded",
    ),
    (
        "eps-probe-wrong-eps-passes",
        "ldlm.export.layernorm.eps_probe:analyse_outputs",
        "if probe.implied_eps_rel_error > probe.eps_rtol:",
        "if False:",
        ("tests/export/layernorm/test_eps_probe_math.py::test_a_wrong_eps_is_named_with_the_implied_value",),
        "a LayerNorm whose implied eps is off is not named by the probes",
    ),
    (
        "parity-fp32-token-gate-lowered",
        "ldlm.export.layernorm.tolerances:TOKEN_AGREEMENT_REQUIRED",
        '"fp32": 1.0',
        '"fp32": 0.99',
        ("tests/export/layernorm/test_tolerances.py::test_the_gates_are_stated_per_precision_in_the_help",),
        "fp32 parity passes with 1% of the tokens changed",
    ),
    (
        "parity-fp32-atol-loosened",
        "ldlm.export.layernorm.tolerances:TOLERANCES",
        '"fp32": (1e-4, 1e-4)',
        '"fp32": (1e-3, 1e-4)',
        ("tests/export/layernorm/test_tolerances.py::test_the_gates_are_stated_per_precision_in_the_help",),
        "fp32 parity passes outputs ten times further from eager than documented",
    ),
    # --- quantization ---------------------------------------------------------------------------------
    (
        "variant-kept-without-its-fp32-sibling",
        "ldlm.export.artifact:check_artifacts",
        'if variants and not resolve_inside(directory, entry["file"]).is_file():',
        "if False:",
        (f"{QUANTIZE_TEST}::test_a_variant_without_its_fp32_sibling_is_refused",),
        "an int8 variant whose fp32 graph is gone is served, with nothing to check it against",
    ),
    (
        "int8-time-embedding-quantized",
        "ldlm.export.quantize:FLOAT_MODULES",
        '("time_mlp", "time_proj", "token_decoder.head")',
        '("token_decoder.head",)',
        ("tests/export/test_quantize_time_embedding.py",),
        "the int8 denoiser quantizes its time embedding: every position's error moves at every step",
    ),
    # --- artifacts and deployments ----------------------------------------------------------------------
    (
        "manifest-path-leaves-directory",
        "ldlm.export.artifact:resolve_inside",
        "if not path.is_relative_to(root):",
        "if False:",
        (
            "tests/export/test_artifact_trust.py::test_manifest_paths_must_stay_inside",
            "tests/export/test_artifact_trust.py::test_symlink_out_of_the_directory_is_refused",
        ),
        "a manifest naming ../../etc/passwd, or a link out of the directory, is followed",
    ),
    (
        "triton-repo-copies-unchecked-export",
        "ldlm.serve.deploy.triton_repo:check_source",
        "check_artifacts(source, json.loads((source / MANIFEST_FILE).read_text()))",
        "None",
        ("tests/serve/deploy/test_triton_repo.py::test_bad_sources_and_existing_output",),
        "ldlm triton-repo copies an export whose files no longer match its manifest",
    ),
    (
        "triton-generate-tokenizer-unchecked",
        "ldlm.serve.deploy.triton_generate:TritonPythonModel.initialize",
        "if found != expected:",
        "if False:",
        ("tests/serve/deploy/test_triton_generate_guards.py::test_an_edited_tokenizer_in_the_repository_is_refused",),
        "ldlm_generate starts with a tokenizer edited in the repository, and every text changes",
    ),
    (
        "ray-replica-holds-five",
        "ldlm.serve.deploy.ray_app:RayOptions",
        "max_ongoing_requests: int = 64",
        "max_ongoing_requests: int = 5",
        ("tests/serve/deploy/test_triton_generate_guards.py::test_ray_options_at_their_edges",),
        "a Ray replica holds Ray's default of 5 requests: continuous batching starves",
    ),
)

SERVING = "docs/serving.md"
CLI = "docs/cli.md"
SAMPLING = "docs/sampling.md"
ENGINES = "docs/engines-and-parity.md"
QUANTIZATION = "docs/quantization.md"
GPU = "docs/gpu.md"
SCALE_OUT = "docs/scale-out.md"
README = "README.md"
ARCHITECTURE = "docs/architecture.md"


def pinned(doc: str, quote: str, *mutation_ids: str) -> tuple[tuple[str, str, str], ...]:
    """One row of ``PROMISES`` per mutation that breaks the promise ``quote`` of ``doc``."""
    return tuple((doc, quote, mutation_id) for mutation_id in mutation_ids)


# (doc file, a quote of the promise, a mutation that breaks it)
PROMISES: tuple[tuple[str, str, str], ...] = (
    # --- README.md ----------------------------------------------------------------------------------------
    *pinned(
        README,
        "It fails, leaving nothing behind, unless each `nn.LayerNorm` became exactly one `LayerNormalization`",
        "verify-count-one-sided",
        "failed-write-leaves-its-temporary-directory",
    ),
    *pinned(README, "After parsing, every LayerNorm must be one `INormalizationLayer` with the module's eps.", "network-eps-unchecked"),
    *pinned(README, "fp16 and bf16 keep LayerNorm, RMSNorm reductions, softmax and logits in FP32", "layernorm-lowered-to-half"),
    *pinned(README, "the server binds 127.0.0.1", "settings-bind-any-address"),
    *pinned(
        README,
        "with every LayerNorm still one float32 `LayerNormalization`, measured before it is kept (`--min-cosine`)",
        "int8-floor-ignored",
    ),
    # --- docs/architecture.md ---------------------------------------------------------------------------
    *pinned(ARCHITECTURE, "`config.json` (the `LDLMConfig`, every field, validated on load)", "config-eps-zero-allowed"),
    # --- docs/cli.md ----------------------------------------------------------------------------------------
    *pinned(
        CLI,
        "no command leaves a partial output directory behind",
        "failed-write-leaves-its-temporary-directory",
        "force-removes-before-the-work",
    ),
    *pinned(CLI, "`--force` replaces an existing one", "checkpoint-overwrite-inverted"),
    *pinned(CLI, "a file that needs full pickle is refused, never run", "import-runs-pickle"),
    *pinned(
        CLI,
        "a shape mismatch or a missing parameter fails the import and writes nothing",
        "import-ignores-shape",
        "import-allows-every-missing",
    ),
    *pinned(
        CLI,
        "one parity round (ONNX Runtime against eager, on the imported weights) runs before OUT appears",
        "import-ignores-failed-parity",
    ),
    *pinned(CLI, "`--prompt`: every sample starts with it, verbatim", "prompt-not-kept-verbatim"),
    *pinned(CLI, "Binds 127.0.0.1 unless told otherwise", "cli-serve-binds-any-address"),
    # --- docs/serving.md ----------------------------------------------------------------------------------
    *pinned(SERVING, "SIGINT/SIGTERM finish the requests in flight, then exit 0.", "sigterm-kills-in-flight"),
    *pinned(SERVING, "gets exactly what `ldlm generate` and `LDLMPipeline.generate` give it", "http-body-fills-in-steps"),
    *pinned(SERVING, "Every answer names the plan that ran", "answer-names-no-plan"),
    *pinned(SERVING, "`top_p` and `logprobs` (0..5) act at the", "top-logprobs-cap-narrowed"),
    *pinned(
        SERVING,
        "A default step count above the server's cap (`max_steps`: 1000, `MAX_STEPS` in `ldlm/limits.py`, as for `ldlm generate`) "
        "is refused (400, naming the default and the range), never cut.",
        "default-steps-cut-to-the-cap",
    ),
    *pinned(SERVING, "a short request is not stuck behind long ones", "short-request-waits-behind-long"),
    *pinned(SERVING, "the scheduler serves the least remaining work first, with aging", "long-request-starved"),
    *pinned(
        SERVING,
        "Every start re-verifies the entry (each file's sha256, the weights it was made from)",
        "export-cache-entry-unverified",
        "export-cache-other-weights-served",
        "export-cache-trusts-cached-grids",
    ),
    *pinned(SERVING, "two servers starting at once take a lock, and the second reuses the first's export", "export-cache-unlocked"),
    *pinned(
        SERVING,
        "the key being a sha256 of the weights, config, tokenizer, tuned grids",
        "export-key-drops-tokenizer",
        "export-key-drops-tuned-grids",
    ),
    *pinned(SERVING, "the exporter's versions and whether it holds INT8 variants", "export-key-drops-quantize"),
    *pinned(SERVING, "`temperature` (0, the default, is the token decoder's argmax)", "temperature-zero-samples"),
    *pinned(SERVING, "seeded by `seed`", "token-draw-ignores-seed"),
    *pinned(SERVING, "`logprobs` (0..5)", "logprobs-above-five-accepted"),
    *pinned(SERVING, "`ldlm export --with-logits` (else 400 naming the fix)", "logits-assumed"),
    *pinned(SERVING, "are accepted only at the value that asks for nothing, else 400 naming them", "openai-best-of-ignored"),
    *pinned(SERVING, "Prompt tokens + `max_tokens` must fit `max_seq_len` (else 400)", "completion-budget-off-by-one"),
    *pinned(SERVING, "its positions are reset at every step to its latents forward-noised to that step's time", "prompt-not-inpainted"),
    *pinned(SERVING, "A client that disconnects frees its slot at the next step.", "scheduler-keeps-cancelled"),
    *pinned(SERVING, "| 64, 8192 | 413 naming the limit |", "kserve-request-samples-uncapped", "kserve-request-tokens-uncapped"),
    *pinned(SERVING, "| `--max-body-mb` | 8 MiB | 413 |", "content-length-cap-off-by-one"),
    *pinned(SERVING, "| `--max-queue` (waiting requests per graph) | 256 | 503 with `Retry-After` |", "queue-full-without-retry-after"),
    *pinned(SERVING, "| 60 s | 504 |", "timeout-answered-500"),
    *pinned(SERVING, "| 10 s, 30 s | connection closed; 408 |", "body-timeout-not-408"),
    *pinned(SERVING, "one execution holds at most `--max-batch` samples", "scheduler-batch-overflows"),
    *pinned(
        SERVING,
        "| `--max-connections` | 1024 | the oldest idle connection is closed; 503 when all are busy |",
        "oldest-idle-connection-kept",
        "busy-connections-unbounded",
    ),
    *pinned(SERVING, "ONNX Runtime's CPU arena is off, so a peak is given back.", "served-arena-kept"),
    *pinned(
        SERVING, "An unhandled error (500) gives the client only the error's type and the request id.", "unhandled-error-leaks-its-message"
    ),
    *pinned(
        SERVING,
        "the request's `X-Request-Id` header, else a fresh hex id; also sent back in the answer's `x-request-id` header",
        "request-id-not-echoed",
    ),
    *pinned(SERVING, "requires `Authorization: Bearer KEY` on every route that runs the model or tells about it", "bearer-never-compared"),
    *pinned(SERVING, "(`/v1`, `/v2` infer and metadata, `/metrics`)", "metrics-open-without-key"),
    *pinned(SERVING, "`/version`, the playground page and `/docs`", "health-prefix-too-wide"),
    *pinned(SERVING, "The key is compared in constant time and never printed", "api-key-printed"),
    *pinned(SERVING, "The server binds 127.0.0.1 unless `--host` says otherwise", "settings-bind-any-address"),
    *pinned(SERVING, "every listed path stays inside the directory", "manifest-path-leaves-directory"),
    *pinned(SERVING, "every file has its recorded sha256", "artifact-sha256-unchecked"),
    *pinned(SERVING, "`warning` drops the request lines", "log-level-ignored"),
    *pinned(SERVING, "The listening socket turns Nagle's algorithm off", "server-socket-without-tcp-proto"),
    # --- docs/sampling.md ---------------------------------------------------------------------------------
    *pinned(
        SAMPLING,
        "so no grid is kept that samples the search never saw do not confirm",
        "tuning-validated-on-the-tuning-seed",
        "tuning-keeps-the-last-candidate",
    ),
    *pinned(SAMPLING, "the default step count is the fewest tuned steps", "default-steps-not-the-fewest"),
    *pinned(SAMPLING, "whose held-out error and token agreement are at least DDIM@50's", "default-matches-ddim50-on-error-alone"),
    *pinned(SAMPLING, "at every held-out length", "default-matches-ddim50-at-one-length"),
    *pinned(
        SAMPLING,
        "a file tuned for other weights, or edited into a grid the samplers cannot run, is refused",
        "tuned-grids-of-other-weights-loaded",
        "schedules-grids-unchecked",
    ),
    *pinned(SAMPLING, "A request that names none gets the config's `prior_temperature` (unset: 1).", "prior-temperature-config-ignored"),
    *pinned(SAMPLING, "τ is in (0, 1]", "prior-temperature-above-one-accepted"),
    *pinned(
        SAMPLING,
        "a run at another τ gets neither the tuned grid nor the step count it made the default",
        "tuned-grid-at-any-prior-temperature",
    ),
    # --- docs/engines-and-parity.md -------------------------------------------------------------------
    *pinned(ENGINES, "with the module's epsilon (compared as float32)", "verify-eps-unchecked", "eps-compared-as-float64"),
    *pinned(
        ENGINES,
        "axis, scale and bias, no decomposed LayerNorm appears",
        "verify-axis-one-sided",
        "verify-compares-names-not-values",
        "verify-decomposed-not-looked-for",
    ),
    *pinned(ENGINES, "`onnx.checker`'s full check passes", "verify-checker-skipped"),
    *pinned(
        ENGINES,
        "every LayerNorm must be one `INormalizationLayer` with the module's eps and axes, or the build fails",
        "network-eps-unchecked",
        "network-axes-ignored",
        "network-count-one-sided",
    ),
    *pinned(
        ENGINES,
        "loading a plan on another TensorRT or GPU fails with what to rebuild",
        "plan-from-another-tensorrt-loaded",
        "plan-from-another-gpu-loaded",
    ),
    *pinned(ENGINES, "bind + enqueue under one lock, one execution context per profile", "trt-no-lock", "trt-one-context-for-all-profiles"),
    *pinned(ENGINES, "splits a batch larger than the profiles into chunks that fit", "trt-no-chunks"),
    *pinned(ENGINES, "A wrong eps fails, naming the node and the module.", "eps-probe-wrong-eps-passes"),
    *pinned(ENGINES, "An element fails only when both its absolute and its relative error exceed them", "compare-atol-or-rtol"),
    *pinned(ENGINES, "| fp32 | 1e-4 | 1e-4 | 100% |", "parity-fp32-token-gate-lowered", "parity-fp32-atol-loosened"),
    *pinned(
        ENGINES,
        "the token agreements reached `token_agreement_required`, the verifier and the eps probes passed",
        "parity-ignores-eps-probes",
    ),
    *pinned(ENGINES, "every comparison passed", "parity-ignores-layer-norms"),
    # --- docs/quantization.md -------------------------------------------------------------------------
    *pinned(QUANTIZATION, "and the verifier refuses a graph where it is not", "qdq-on-layernorm-allowed"),
    *pinned(QUANTIZATION, "a file is the precision its manifest says", "int8-claim-unchecked"),
    *pinned(QUANTIZATION, "a variant whose fp32 sibling is missing is refused", "variant-kept-without-its-fp32-sibling"),
    *pinned(QUANTIZATION, "`ldlm probe-eps` and `ldlm parity` probe the variants' LayerNorms too", "variants-not-probed"),
    *pinned(QUANTIZATION, "must be at least `--min-cosine` (0.9999)", "int8-floor-ignored"),
    *pinned(
        QUANTIZATION,
        "the time embedding (one row per sample: nothing to gain, and its error moves every position)",
        "int8-time-embedding-quantized",
    ),
    *pinned(QUANTIZATION, "`ldlm serve OUT --precision int8` runs the variants", "int8-serves-fp32"),
    *pinned(
        QUANTIZATION,
        "the verifier refuses a Q/DQ graph where a norm is inside a Q/DQ pair or a zero point is not 0",
        "qdq-asymmetric-zero-point-passes",
    ),
    *pinned(
        QUANTIZATION,
        "LayerNorm, RMSNorm, softmax, the time embedding, the vocabulary head and the biases stay float",
        "qdq-quantizes-the-float-modules",
    ),
    # --- docs/gpu.md ------------------------------------------------------------------------------------
    *pinned(GPU, "the command says so (naming onnxruntime-gpu) instead of silently running on the CPU", "ort-cuda-runs-on-the-cpu"),
    *pinned(
        GPU, "on CUDA **fp16 is the default** (`ldlm serve`, `ldlm parity` and `ldlm bench` alike", "bench-times-torch-in-fp32-on-cuda"
    ),
    *pinned(GPU, "`ldlm parity CKPT --device cuda` checks the default before you ship", "parity-checks-the-cpu-default-on-cuda"),
    *pinned(
        GPU,
        "The server caps the samples per execution and the request lengths at what the profiles take",
        "trt-service-ignores-profile-batch",
    ),
    # --- docs/scale-out.md ------------------------------------------------------------------------------
    *pinned(SCALE_OUT, "Only files that match their records are copied", "triton-repo-copies-unchecked-export"),
    *pinned(SCALE_OUT, "the model refuses to start if the file beside it differs", "triton-generate-tokenizer-unchecked"),
    *pinned(SCALE_OUT, "at most the profiles' largest batch, which Triton requires", "triton-max-batch-beyond-profiles"),
    *pinned(SCALE_OUT, "Both listen on `127.0.0.1:8000` unless told otherwise", "settings-bind-any-address"),
    *pinned(SCALE_OUT, "`max_ongoing_requests` (64)", "ray-replica-holds-five"),
)
