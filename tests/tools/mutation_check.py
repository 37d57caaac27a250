#!/usr/bin/env python3
"""Plant one-line bugs, one at a time, and check that the test suite fails: what the mutation-testing tool
(tests/tools/mutation_score.py, mutmut over the hot path) cannot express. The promises README.md and docs/
make (tests/tools/mutation_promises.py maps each quote to the bug that breaks it), files that are not Python,
and modules outside the tool's scope; a module in its scope keeps here only the bugs that break a promise.

Each mutation names its target by module and name, ``ldlm.serve.runtime.scheduler:GenerationScheduler._admit``:
a function, a ``Class.method`` (nested definitions by their dotted path), a class, or a name a module or a
class assigns (``ldlm.serve.runtime.scheduler:LEAD_SLOWDOWN``). The module's file follows pyproject's
package-dir mapping (``ldlm.serve.api.kserve`` -> ``serve/api/kserve.py``). The ``old`` text must occur exactly
once within the target's source (its lines, decorators included), and the bug replaces it there only, so
the same text may occur elsewhere in the file, and the target may move within its file or to another
module (then only its module name changes here) without the entry going stale. A file that is not
Python is named by its path instead, and ``old`` must occur once in the whole file.

Each mutation is applied to a scratch copy of the repository (never to this checkout), the tests
most likely to catch it run first (``pytest -x``), and only if they all pass does the rest of the
suite run. A mutation is *caught* when a test of its module's behaviour fails: one of its named tests
(a failing test, an import error, or a run past ``--timeout-s``), or, in the rest of the suite, a test
in a file that mirrors its module (``serve/api/export_cache.py`` -> ``tests/serve/api/test_export_cache.py``
or ``test_export_cache_<aspect>.py``). It is *caught elsewhere* when only some other test fails (the
report names it): the bug is noticed, but by a test of another behaviour, so the module's own tests
have a gap all the same. It is *survived* when every test passes: a gap to close with a sharper test.

The scratch copy imports its own code: a scratch venv whose site-packages reaches this checkout's
``.venv`` site-packages (the dependencies) through a .pth line, with the copy installed editable
into it (the package-dir mapping ldlm.export -> export/, ldlm.serve -> serve/ rules out PYTHONPATH).

    .venv/bin/python tests/tools/mutation_check.py                   # every mutation, JSON + table
    .venv/bin/python tests/tools/mutation_check.py --only batcher-pads-with-one --quick
    .venv/bin/python tests/tools/mutation_check.py --list

Not part of CI: it takes minutes (each pytest process pays the tiny model's fixtures again). In CI,
tests/tools/test_mutation_list.py checks that every entry still finds its target and its text.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__:  # imported as tests.tools.mutation_check
    from .mutation_promises import PROMISE_MUTATIONS
else:  # run as a script: this folder is on sys.path, the repository root is not
    from mutation_promises import PROMISE_MUTATIONS  # type: ignore[no-redef]

ROOT = Path(__file__).resolve().parents[2]
# The list's own test fails on any edit to a targeted function, so it would "catch" every mutation: it is
# set aside in every run, and a mutation only it notices counts as survived.
LIST_TEST = "tests/tools/test_mutation_list.py"
NAMED_STAGE, REST_STAGE = "named tests", "rest of the suite"
CAUGHT, CAUGHT_ELSEWHERE, SURVIVED = "caught", "caught elsewhere", "survived"


@dataclass(frozen=True)
class Mutation:
    id: str
    target: str  # "module:qualname" (see the module docs), or a non-Python file's path relative to the repository root
    old: str  # must occur exactly once in the target's source
    new: str
    # the tests most likely to catch it, run first: test files, or tests by pytest's node id (file::test)
    tests: tuple[str, ...]
    bug: str  # what a user would see


MUTATIONS: tuple[Mutation, ...] = (
    # --- one in each core stage: scheduler, pipeline, batcher, precision, bench -----------------------
    Mutation(
        "reconstruct-drops-mask",
        "ldlm.pipeline:LDLMPipeline.reconstruct",
        "return self.decode(encoded.latents, encoded.attention_mask)",
        "return self.decode(encoded.latents)",
        ("tests/ldlm/test_pipeline_values.py",),
        "padded rows of a batch decode their padding",
    ),
    Mutation(
        "bf16-rounding-garbled",
        "ldlm.export.precision:_low_initializer",
        ">> 16).astype(np.uint16)",
        ">> 15).astype(np.uint16)",
        ("tests/export/test_precision_values.py",),
        "every bf16 weight garbled",
    ),
    Mutation(
        "bench-speedup-inverted",
        "ldlm.serve.checks.bench_latency:bench_graphs",
        'entry[REFERENCE_BACKEND]["p50_ms"] / entry[name]["p50_ms"]',
        'entry[name]["p50_ms"] / entry[REFERENCE_BACKEND]["p50_ms"]',
        ("tests/serve/checks/test_bench_values.py",),
        "a 4x faster backend reported as x0.25",
    ),
    # --- scheduler ------------------------------------------------------------------------------
    Mutation(
        "scheduler-batch-overflows",
        "ldlm.serve.runtime.policy:FirstComeFirstServed.select",
        "len(chosen) < self.max_batch",
        "len(chosen) <= self.max_batch",
        ("tests/serve/runtime/test_scheduler_values.py",),
        "denoiser batches one larger than max_batch (past the engine profile)",
    ),
    Mutation(
        "scheduler-keeps-cancelled",
        "ldlm.serve.runtime.scheduler:GenerationScheduler._drop_done",
        "if self._active.pop(id(s), None) is not None]",
        "if self._active.get(id(s)) is not None]",
        (
            "tests/serve/runtime/test_scheduler_values.py",
            "tests/serve/runtime/test_scheduler.py",
            "tests/serve/runtime/test_scheduler_cancellation.py",
        ),
        "cancelled or failed requests keep their slots",
    ),
    # --- batcher --------------------------------------------------------------------------------
    # --- pipeline -------------------------------------------------------------------------------
    Mutation(
        "encode-mask-all-true",
        "ldlm.pipeline:LDLMPipeline.encode",
        "mask[i, : len(row)] = True",
        "mask[i, :] = True",
        ("tests/ldlm/test_pipeline_values.py",),
        "short texts in a batch attend their padding",
    ),
    Mutation(
        "decode-texts-not-cut",
        "ldlm.pipeline:LDLMPipeline.decode",
        "self.tokenizer.decode(row[:n].tolist())",
        "self.tokenizer.decode(row.tolist())",
        ("tests/ldlm/test_pipeline_values.py",),
        "texts include the decoded padding",
    ),
    Mutation(
        "token-ids-keep-padding",
        "ldlm.pipeline:TextResult.ids",
        "return [row[:n].tolist() for row, n in zip(self.token_ids, self.lengths)]",
        "return [row.tolist() for row, n in zip(self.token_ids, self.lengths)]",
        ("tests/ldlm/test_pipeline_reconstruct_ids.py",),
        "a batched text's ids include the padded positions",
    ),
    # --- sampler --------------------------------------------------------------------------------
    Mutation(
        "sample-seeds-shared",
        "ldlm.sampling.noise:sample_seeds",
        "int(s) >> 1 for s in states",
        "int(states[0]) >> 1 for s in states",
        ("tests/ldlm/test_pipeline_values.py",),
        "every sample of a request is the same text",
    ),
    # --- precision ------------------------------------------------------------------------------
    Mutation(
        "head-lowered-to-fp16",
        "ldlm.export.precision:_fp32_nodes",
        'n.op_type == "ArgMax"]',
        'n.op_type == "ArgMin"]',
        ("tests/export/test_precision_values.py",),
        "the vocabulary head runs in FP16 (argmax flips)",
    ),
    Mutation(
        "fp16-weights-stored-as-bf16",
        "ldlm.export.precision:_low_initializer",
        "if low == TensorProto.FLOAT16:",
        "if low == TensorProto.BFLOAT16:",
        ("tests/export/test_precision_values.py",),
        "fp16 weights written in the bf16 layout",
    ),
    # --- verify / layernorm_network ---------------------------------------------------------------
    Mutation(
        "verify-axis-one-sided",
        "ldlm.export.layernorm.verify:_check_node",
        "if axis != spec.axis:",
        "if axis > spec.axis:",
        ("tests/export/layernorm/test_verify_values.py", "tests/export/layernorm/test_verify.py"),
        "a LayerNorm over two axes passes verification",
    ),
    Mutation(
        "verify-count-one-sided",
        "ldlm.export.layernorm.verify:check_layer_norms",
        "if len(nodes) != len(expected):",
        "if len(nodes) < len(expected):",
        ("tests/export/layernorm/test_verify_values.py",),
        "an extra LayerNormalization node passes verification",
    ),
    Mutation(
        "verify-compares-names-not-values",
        "ldlm.export.layernorm.verify:_check_parameter",
        "if digest(value) == sha256:",
        "if input_name.endswith(('.weight', '.bias')) or digest(value) == sha256:",
        ("tests/export/layernorm/test_verify_values.py",),
        "a weight with the right name and the wrong values passes",
    ),
    Mutation(
        "network-num-groups-ignored",
        "ldlm.export.layernorm.trt_network:check_network_layer_norms",
        'if getattr(layer, "num_groups", 1) != 1:',
        'if getattr(layer, "num_groups", 1) > 2:',
        ("tests/export/layernorm/test_trt_network.py",),
        "a GroupNorm taken for a LayerNorm",
    ),
    Mutation(
        "network-count-one-sided",
        "ldlm.export.layernorm.trt_network:check_network_layer_norms",
        "if len(layers) != len(specs):",
        "if len(layers) < len(specs):",
        ("tests/export/layernorm/test_trt_network.py",),
        "extra INormalizationLayers pass the check",
    ),
    Mutation(
        "network-axes-ignored",
        "ldlm.export.layernorm.trt_network:check_network_layer_norms",
        "if layer.axes != expected:",
        "if layer.axes & expected != expected:",
        ("tests/export/layernorm/test_trt_network.py",),
        "a layer normalizing extra axes passes the check",
    ),
    Mutation(
        "strongly-typed-hard-coded",
        "ldlm.export.trt_flavor:is_strongly_typed",
        "return flag is not None and bool(network.get_flag(flag))",
        "return True",
        ("tests/export/layernorm/test_trt_network.py",),
        "the manifest claims strong typing it did not read",
    ),
    # --- kserve ---------------------------------------------------------------------------------
    Mutation(
        "kserve-limit-off-by-one",
        "ldlm.serve.api.kserve:decompress",
        "if len(out) > limit or decoder.unconsumed_tail:",
        "if len(out) > limit + 1 or decoder.unconsumed_tail:",
        ("tests/serve/api/test_kserve_values.py",),
        "a compressed body one byte over the cap is accepted",
    ),
    Mutation(
        "kserve-binary-offset-ignored",
        "ldlm.serve.api.kserve:_input_tensor",
        "binary[offset : offset + size]",
        "binary[0:size]",
        ("tests/serve/api/test_kserve_values.py",),
        "every binary input reads the first tensor's bytes",
    ),
    # --- parity / compare -----------------------------------------------------------------------
    Mutation(
        "parity-ignores-decoder-tokens",
        "ldlm.serve.checks.parity_result:ParityReport.passed",
        "and e2e and structure and decoder",
        "and e2e and structure",
        ("tests/serve/checks/test_parity_rules.py",),
        "a decoder whose argmax disagrees passes parity",
    ),
    Mutation(
        "parity-ignores-eps-probes",
        "ldlm.serve.checks.parity_result:ParityReport.passed",
        " and (self.eps_probes is None or self.eps_probes.passed)",
        "",
        ("tests/serve/checks/test_parity_rules.py", "tests/export/layernorm/test_eps_probe.py"),
        "a LayerNorm whose eps is off passes parity",
    ),
    Mutation(
        "artifact-sha256-unchecked",
        "ldlm.export.artifact:check_file",
        'if sha256_file(path) != record["sha256"]:',
        "if False:",
        ("tests/export/test_artifact_trust.py",),
        "edited weights of the same size are served",
    ),
    Mutation(
        "prompt-not-inpainted",
        "ldlm.sampling.slots:SlotTable._inputs",
        "if len(layout.prompted):",
        "if False:",
        ("tests/serve/api/routes/test_openai.py",),
        "a completion ignores its prompt",
    ),
    Mutation(
        "parity-ignores-layer-norms",
        "ldlm.serve.checks.parity_result:ParityReport.passed",
        "ok = all(c.passed for c in self.graphs) and all(c.passed for c in self.layer_norms)",
        "ok = all(c.passed for c in self.graphs)",
        ("tests/serve/checks/test_parity_rules.py",),
        "a diverging LayerNorm output passes parity",
    ),
    Mutation(
        "compare-atol-or-rtol",
        "ldlm.export.layernorm.compare:compare_outputs",
        "failing = (diff > atol) & (rel > rtol)",
        "failing = (diff > atol) | (rel > rtol)",
        ("tests/serve/checks/test_parity.py", "tests/serve/checks/test_parity_rules.py"),
        "elements within rtol fail on atol alone",
    ),
    # --- bench ----------------------------------------------------------------------------------
    Mutation(
        "bench-samples-per-s-ignores-batch",
        "ldlm.serve.checks.bench_latency:bench_graphs",
        "round(1000 * batch / p50, 2)",
        "round(1000 / p50, 2)",
        ("tests/serve/checks/test_bench_values.py",),
        "throughput of batch 8 reported as batch 1's",
    ),
    Mutation(
        "bench-tokens-per-s-ignores-n",
        "ldlm.serve.checks.bench_latency:bench_generation",
        "round(n * length / p50, 2)",
        "round(length / p50, 2)",
        ("tests/serve/checks/test_bench_values.py",),
        "generation tokens/s n times too low",
    ),
    Mutation(
        "bench-throughput-ratio-inverted",
        "ldlm.serve.checks.bench_workload:bench_batching",
        'batching["continuous"]["tokens_per_s"] / batching["static"]["tokens_per_s"]',
        'batching["static"]["tokens_per_s"] / batching["continuous"]["tokens_per_s"]',
        ("tests/serve/checks/test_bench.py",),
        "continuous batching's gain reported upside down",
    ),
    # --- the TensorRT runtime, the service's limits, the tokenizer check, the Triton cap --------------
    Mutation(
        "trt-no-lock",
        "ldlm.serve.runtime.tensorrt_executor:PlanExecutor._execute_one",
        "with self._lock:  # the context's shapes",
        "if True:  # the context's shapes",
        ("tests/serve/runtime/test_tensorrt_executor.py",),
        "two server threads rebind one context: a call reads another call's inputs",
    ),
    Mutation(
        "trt-no-chunks",
        "ldlm.serve.runtime.tensorrt_executor:PlanExecutor.execute",
        "        if len(chunks) == 1:\n",
        "        if True:\n",
        ("tests/serve/runtime/test_tensorrt_executor.py",),
        "n > 32 on /v1/generate fails the whole batch with 'outside every profile'",
    ),
    Mutation(
        "trt-shape-result-ignored",
        "ldlm.export.trt_flavor:set_input_shape",
        "if not context.set_input_shape(name, shape):",
        "if context.set_input_shape(name, shape) is None:",
        ("tests/serve/runtime/test_tensorrt_executor.py",),
        "a shape TensorRT rejected runs anyway, on stale shapes",
    ),
    Mutation(
        "trt-address-result-ignored",
        "ldlm.export.trt_flavor:set_tensor_address",
        "if not context.set_tensor_address(name, tensor.data_ptr()):",
        "if context.set_tensor_address(name, tensor.data_ptr()) is None:",
        ("tests/serve/runtime/test_tensorrt_executor.py",),
        "a rejected address runs anyway, reading or writing stale memory",
    ),
    Mutation(
        "trt-one-context-for-all-profiles",
        "ldlm.serve.runtime.tensorrt_executor:PlanExecutor._context",
        "        if profile not in self._contexts:\n",
        "        if not self._contexts:\n",
        ("tests/serve/runtime/test_tensorrt_executor.py",),
        "a batch of the second profile runs on the first profile's context",
    ),
    Mutation(
        "trt-stale-cache-counted-as-loaded",
        "ldlm.serve.runtime.trt_runtime:RuntimeCacheFile.attach",
        "self.loaded = bool(cache.deserialize(self.path.read_bytes()))",
        "cache.deserialize(self.path.read_bytes()); self.loaded = True",
        ("tests/serve/runtime/test_tensorrt_executor.py",),
        "a runtime cache from another driver is reported as loaded",
    ),
    Mutation(
        "trt-logger-history-unbounded",
        "ldlm.export.trt_flavor:_make_logger.RecordingLogger.__init__",
        "deque(maxlen=LOG_HISTORY)",
        "deque()",
        ("tests/export/layernorm/test_trt_network.py",),
        "a long-running server's TensorRT message list grows without bound",
    ),
    Mutation(
        "trt-progress-arguments-swapped",
        "ldlm.export.engine_builder:BuildProgress.Monitor.phase_start",
        "def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int)",
        "def phase_start(self, parent_phase: str | None, phase_name: str, num_steps: int)",
        ("tests/export/layernorm/test_trt_network.py",),
        "build-engine shows no progress bar",
    ),
    Mutation(
        "trt-service-ignores-profile-batch",
        "ldlm.serve.runtime.backends:serving_limits",
        "return capped, min([max_batch, *limits])",
        "return capped, max_batch",
        ("tests/serve/runtime/test_tensorrt_executor.py",),
        "the server batches more samples per execution than the engine's profiles hold",
    ),
    Mutation(
        "tokenizer-not-checked",
        "ldlm.export.artifact:check_artifacts",
        '    check_tokenizer(directory, manifest.get("tokenizer"))',
        "    pass",
        ("tests/export/test_artifact_trust.py",),
        "an edited tokenizer.json changes every answer of a server, unnoticed",
    ),
    Mutation(
        "triton-max-batch-beyond-profiles",
        "ldlm.serve.deploy.triton_repo:model_config",
        'max_batch = min(max_batch, max(p["batch"][2] for p in profiles))',
        "pass",
        ("tests/serve/deploy/test_triton_repo.py",),
        "Triton refuses the plans: max_batch_size above the profiles' largest batch",
    ),
    Mutation(
        "triton-int8-repository-serves-fp32",
        "ldlm.serve.deploy.triton_repo:inspect_source",
        'for f in (chosen[g] or e)["files"]',
        'for f in e["files"]',
        ("tests/serve/deploy/test_triton_repo.py",),
        "a repository written with --precision int8 says int8 in every config and serves the fp32 graphs",
    ),
    # --- the solvers, and the solver state the scheduler keeps per sample -----------------------------
    # --- the model's modules, checked against NumPy ---------------------------------------------------
    Mutation(
        "rmsnorm-eps-dropped",
        "ldlm.model.layers:RMSNorm.forward",
        "return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight",
        "return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True)) * self.weight",
        ("tests/ldlm/model/test_layers_values.py",),
        "RMSNorm divides by zero on a zero row and ignores the config's eps",
    ),
    Mutation(
        "mlp-gelu-tanh",
        "ldlm.model.layers:MLP.forward",
        "return self.fc_out(self.dropout(F.gelu(self.fc_in(self.norm(x)))))",
        'return self.fc_out(self.dropout(F.gelu(self.fc_in(self.norm(x)), approximate="tanh")))',
        ("tests/ldlm/model/test_layers_values.py",),
        "the Perceivers' MLPs use GPT-2's approximate GELU, not the exact one",
    ),
    Mutation(
        "position-scale-inverted",
        "ldlm.model.layers:PositionTable.__init__",
        "self.scale = dim**-0.5",
        "self.scale = dim**0.5",
        ("tests/ldlm/model/test_layers_values.py",),
        "position tables scaled by sqrt(D) instead of 1/sqrt(D)",
    ),
    Mutation(
        "per-stream-kv-ignored",
        "ldlm.model.layers:LatentAttention.forward",
        "kv_context = self.kv_context if self.kv_context is not None else self.kv",
        "kv_context = self.kv",
        ("tests/ldlm/model/test_layers_values.py",),
        "the context's own key/value projection is loaded but never used",
    ),
    Mutation(
        "k-norm-skipped",
        "ldlm.model.layers:LatentAttention.forward",
        "k = self.k_norm(split_heads(k, self.n_heads))  # (B, H, S, hd)",
        "k = split_heads(k, self.n_heads)  # (B, H, S, hd)",
        ("tests/ldlm/model/test_layers_values.py",),
        "Perceiver keys are not RMS-normed per head",
    ),
    Mutation(
        "causal-mask-upper",
        "ldlm.model.layers:attention_bias",
        ".tril()[None, None]",
        ".triu()[None, None]",
        ("tests/ldlm/model/test_layers_values.py", "tests/ldlm/model/test_gpt2.py"),
        "GPT-2 features attend the future instead of the past",
    ),
    Mutation(
        "query-stream-padding-unmasked",
        "ldlm.model.layers:stream_bias",
        "attention_bias(torch.cat([mask, mask], dim=1), dtype)",
        "attention_bias(torch.cat([mask, torch.ones_like(mask)], dim=1), dtype)",
        ("tests/ldlm/model/test_layers_values.py",),
        "padded positions' latents leak into the real positions",
    ),
    Mutation(
        "time-embedding-cos-sin-swapped",
        "ldlm.model.layers:sinusoidal_embedding",
        "return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)",
        "return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)",
        ("tests/ldlm/model/test_layers_values.py",),
        "the denoiser reads its time embedding in the wrong order (a trained checkpoint denoises at the wrong t)",
    ),
    Mutation(
        "context-normed-with-query-norm",
        "ldlm.model.layers:LatentAttention.forward",
        "xq, xc = self.norm_query(query), self.norm_context(context)",
        "xq, xc = self.norm_query(query), self.norm_query(context)",
        ("tests/ldlm/model/test_layers_values.py",),
        "the context stream is normed with the query stream's gain",
    ),
    Mutation(
        "wide-denoiser-skips-its-blocks",
        "ldlm.model.denoiser:Denoiser.forward",
        "return self.out_norm(self.out_proj(x))",
        "return self.out_norm(self.out_proj(x if isinstance(self.in_proj, nn.Identity) else self.in_proj(x_t)))",
        ("tests/ldlm/model/test_denoiser_width.py",),
        "a denoiser wider than the latents returns its projected input, untouched by the blocks",
    ),
    Mutation(
        "wide-denoiser-drops-self-conditioning",
        "ldlm.model.denoiser:DenoiserBlock.forward",
        "x = x + self.time_proj(time)[:, None, :] + self.self_cond_proj(x0_prev)",
        "x = x + self.time_proj(time)[:, None, :] + self.self_cond_proj(x0_prev) * (self.self_cond_proj.in_features == self.self_cond_proj.out_features)",
        ("tests/ldlm/model/test_denoiser_width.py",),
        "a denoiser wider than the latents ignores the previous x0_hat",
    ),
    Mutation(
        "tuned-grid-at-any-prior-temperature",
        "ldlm.sampling.tuned_grids:TunedSchedules.tuned_for",
        "return t_min == self.t_min and prior_temperature == self.prior_temperature",
        "return t_min == self.t_min",
        ("tests/ldlm/sampling/test_loop_prior_temperature.py",),
        "a grid tuned from one prior temperature runs, as the tuned default, from another",
    ),
    Mutation(
        "denoiser-norm-takes-layer-norm-eps",
        "ldlm.model.denoiser:DenoiserBlock.__init__",
        "self.mlp_norm = RMSNorm(w, config.rms_norm_eps)",
        "self.mlp_norm = RMSNorm(w, config.layer_norm_eps)",
        ("tests/ldlm/model/test_layers_values.py",),
        "the denoiser's MLP norms use the LayerNorm eps (equal in every preset, not in a trained config)",
    ),
    Mutation(
        "gpt2-gelu-exact",
        "ldlm.model.gpt2:GPT2MLP.forward",
        'return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))',
        "return self.c_proj(F.gelu(self.c_fc(x)))",
        ("tests/ldlm/model/test_layers_values.py", "tests/ldlm/model/test_gpt2.py"),
        "features differ from Hugging Face's GPT-2 (gelu_new)",
    ),
    Mutation(
        "gpt2-ln2-reused",
        "ldlm.model.gpt2:GPT2Block.forward",
        "return x + self.mlp(self.ln_2(x))",
        "return x + self.mlp(self.ln_1(x))",
        ("tests/ldlm/model/test_layers_values.py", "tests/ldlm/model/test_gpt2.py"),
        "GPT-2's MLP reads the attention's LayerNorm",
    ),
    Mutation(
        "latent-bank-not-normed",
        "ldlm.model.latent_encoder:LatentEncoder.forward",
        "latents = self.latent_norm(self.latent_bank[:length])[None]",
        "latents = self.latent_bank[:length][None]",
        ("tests/ldlm/model/test_layers_values.py",),
        "the encoder's initial latents skip their RMSNorm",
    ),
    Mutation(
        "encoder-out-norm-skipped",
        "ldlm.model.latent_encoder:LatentEncoder.forward",
        "return self.out_norm(latents)",
        "return latents",
        ("tests/ldlm/model/test_layers_values.py",),
        "latents leave the encoder un-normed",
    ),
    Mutation(
        "query-scale-weight-dropped",
        "ldlm.model.latent_decoder:LatentDecoder.forward",
        "scale = 1 + self.query_scale.weight[0, 0] + self.query_scale.bias[0]",
        "scale = 1 + self.query_scale.bias[0]",
        ("tests/ldlm/model/test_layers_values.py",),
        "a trained query scale's weight is ignored",
    ),
    Mutation(
        "decoder-attn-scale-dropped",
        "ldlm.model.latent_decoder:DecoderBlock.forward",
        "queries = queries + self.attn_scale * self.attn(queries, latents, attn_bias)",
        "queries = queries + self.attn(queries, latents, attn_bias)",
        ("tests/ldlm/model/test_layers_values.py",),
        "the decoder blocks' learned attention scale is ignored",
    ),
    Mutation(
        "token-decoder-final-norm-skipped",
        "ldlm.model.token_decoder:TokenDecoder.hidden",
        "return self.norm(h)",
        "return h",
        ("tests/ldlm/model/test_layers_values.py",),
        "the vocabulary head reads un-normed features",
    ),
    Mutation(
        "token-decoder-causal",
        "ldlm.model.token_decoder:TokenDecoder.hidden",
        "bias = attention_bias(mask, h.dtype)  # bidirectional",
        "bias = attention_bias(mask, h.dtype, causal_len=h.shape[1])  # bidirectional",
        ("tests/ldlm/model/test_layers_values.py",),
        "the token decoder only looks left",
    ),
    # --- fused steps: every batch of one sampler, and a failure that changes no sample ---------------------
    Mutation(
        "executor-never-fuses",
        "ldlm.serve.runtime.executor:StepExecutor._step",
        "if self.fused is not None and table.fusable():",
        "if False:",
        ("tests/serve/runtime/test_scheduler_fused.py",),
        "a compiled denoiser's steps run the denoiser and the sampler's update apart: one CUDA graph per step lost",
    ),
    Mutation(
        "fused-slot-index-never-refreshed",
        "ldlm.serve.runtime.torch_backends:FusedSteps._fill",
        "if prepared.slots_host is not rows.slots_host:",
        "if prepared.slots_host is None:",
        ("tests/serve/runtime/test_torch_backends_fused.py",),
        "a captured step keeps gathering the rows it first ran: samples that joined later are not stepped",
    ),
    # --- when a batch starts: at once for a request at an idle batcher, after the window for the others ---
    # --- the vocabulary head: its argmax by block maxima, a chunk of the vocabulary at a time --------------
    Mutation(
        "head-block-tie-goes-last",
        "ldlm.model.token_decoder:block_argmax",
        "best = torch.cat(maxima, 1).argmax(-1, keepdim=True)",
        "best = torch.cat(maxima, 1).shape[1] - 1 - torch.cat(maxima, 1).flip(1).argmax(-1, keepdim=True)",
        ("tests/ldlm/model/test_token_decoder.py",),
        "a token tied across two blocks of the vocabulary is the later one, not argmax's first",
    ),
    Mutation(
        "head-block-offset-dropped",
        "ldlm.model.token_decoder:block_argmax",
        "best.squeeze(-1) * block + logits.argmax(-1)",
        "best.squeeze(-1) + logits.argmax(-1)",
        ("tests/ldlm/model/test_token_decoder.py",),
        "every token past the first block of the vocabulary comes back as another",
    ),
    Mutation(
        "head-recomputed-block-shifted",
        "ldlm.model.token_decoder:block_argmax",
        "columns = (best * block + torch.arange",
        "columns = (best * block + 1 + torch.arange",
        ("tests/ldlm/model/test_token_decoder.py",),
        "the winning block's logits are computed again one column off, so the token is its neighbour",
    ),
    Mutation(
        "head-padding-wins",
        "ldlm.model.token_decoder:_filled",
        "columns[-1:].expand(missing, -1)",
        "columns.new_zeros(missing, columns.shape[1])",
        ("tests/ldlm/model/test_token_decoder.py",),
        "the columns that fill the last block score 0, and win (an id past the vocabulary) where every logit is negative",
    ),
    Mutation(
        "head-vocabulary-unchunked",
        "ldlm.model.token_decoder:block_argmax",
        "width = -(-vocab // block) * block",
        "width = -(-vocab // block) * block; chunk = width",
        ("tests/export/test_graphs_head.py",),
        "the decoder makes the whole (B*L, V) logits in one product, out of the CPU's cache: slower",
    ),
    Mutation(
        "head-chunk-maxima-lowered-to-fp16",
        "ldlm.export.precision:_fp32_nodes",
        "walk += [(x, past_head) for x in nodes[i].input if types.get(x) == FLOAT]",
        "walk += [(x, past_head) for x in nodes[i].input[:1] if types.get(x) == FLOAT]",
        ("tests/export/test_precision_values.py",),
        "an fp16 decoder compares the vocabulary chunks' maxima rounded to fp16 (ties pick other tokens)",
    ),
    # --- config and checkpoint ------------------------------------------------------------------------
    Mutation(
        "config-int-range-top-refused",
        "ldlm.model.config:_validate",
        "type(value) is int and low <= value <= high",
        "type(value) is int and low <= value < high",
        ("tests/ldlm/model/test_config_guards.py",),
        "the documented top of every integer range (256 denoiser layers, ...) refused",
    ),
    Mutation(
        "config-eps-zero-allowed",
        "ldlm.model.config:_validate",
        "math.isfinite(value) and above < value <= at_most",
        "math.isfinite(value) and above <= value <= at_most",
        ("tests/ldlm/model/test_config_guards.py",),
        "a config with eps 0 loads: a zero row normalizes to NaN",
    ),
    Mutation(
        "config-eos-off-by-one",
        "ldlm.model.config:_validate",
        "require(0 <= c.eos_token_id < c.vocab_size,",
        "require(0 <= c.eos_token_id <= c.vocab_size,",
        ("tests/ldlm/model/test_config_guards.py",),
        "an end-of-text id past the vocabulary loads",
    ),
    Mutation(
        "config-dropout-one-allowed",
        "ldlm.model.config:_validate",
        "require(0.0 <= c.dropout < 1.0,",
        "require(0.0 <= c.dropout <= 1.0,",
        ("tests/ldlm/model/test_config_guards.py",),
        "dropout 1 (every activation zeroed in training) loads",
    ),
    Mutation(
        "feature-blocks-off-by-one",
        "ldlm.model.config:LDLMConfig.feature_blocks",
        "return self.gpt2_layers + 1 + self.feature_layer",
        "return self.gpt2_layers + self.feature_layer",
        ("tests/ldlm/model/test_config_guards.py", "tests/ldlm/model/test_gpt2.py"),
        "features read one GPT-2 block too early",
    ),
    Mutation(
        "checkpoint-unexpected-not-named",
        "ldlm.model.checkpoint:check_state_dict",
        "unexpected = sorted(set(found) - set(expected))",
        "unexpected = []",
        ("tests/ldlm/model/test_checkpoint.py",),
        "a checkpoint with extra tensors fails with torch's error, not ours",
    ),
    Mutation(
        "mask-embedding-off-by-one",
        "ldlm.model.checkpoint:load_gpt2_weights",
        "if config.mask_token_id < wte.shape[0] else",
        "if config.mask_token_id <= wte.shape[0] else",
        ("tests/ldlm/model/test_gpt2.py",),
        "ldlm init --gpt2-dir fails with an IndexError for the mask token",
    ),
    Mutation(
        "random-std-negative",
        "ldlm.model.checkpoint:randomize_norms",
        "std.copy_(torch.exp(normal(std, 0.2)))",
        "std.copy_(normal(std, 0.2))",
        ("tests/export/layernorm/test_eps_probe.py",),
        "norm_init=random draws negative standard deviations",
    ),
    Mutation(
        "checkpoint-overwrite-inverted",
        "ldlm.files:refuse_existing",
        "    if not overwrite:\n        raise FileExistsError",
        "    if overwrite:\n        raise FileExistsError",
        ("tests/ldlm/model/test_checkpoint.py",),
        "an existing checkpoint is replaced without --force",
    ),
    # --- OpenAI completions ---------------------------------------------------------------------------
    Mutation(
        "completion-budget-off-by-one",
        "ldlm.serve.api.routes.openai:Completions.prepare",
        "if len(row) + body.max_tokens > config.max_seq_len:",
        "if len(row) + body.max_tokens >= config.max_seq_len:",
        ("tests/serve/api/test_http_guard.py",),
        "a prompt that exactly fills max_seq_len with max_tokens is refused",
    ),
    # --- streaming and the outer guard ---------------------------------------------------------------
    Mutation(
        "body-cap-off-by-one",
        "ldlm.serve.api.http_guard:read_body",
        "if received > limit:  # chunked",
        "if received >= limit:  # chunked",
        ("tests/serve/api/test_http_guard_middleware.py",),
        "a chunked body of exactly --max-body-mb is refused",
    ),
    Mutation(
        "content-length-cap-off-by-one",
        "ldlm.serve.api.http_guard:read_body",
        "int(content_length) > limit):",
        "int(content_length) >= limit):",
        ("tests/serve/api/test_http_guard_middleware.py",),
        "a body of exactly --max-body-mb is refused",
    ),
    Mutation(
        "health-prefix-too-wide",
        "ldlm.serve.api.http_guard:GuardMiddleware.OPEN_PREFIXES",
        'OPEN_PREFIXES = ("/v2/health/", "/static/swagger/")',
        'OPEN_PREFIXES = ("/v2/health", "/static/swagger/")',
        ("tests/serve/api/test_http_guard_middleware.py",),
        "paths that merely start with /v2/health skip the bearer check",
    ),
    Mutation(
        "queue-full-without-retry-after",
        "ldlm.serve.api.errors:error_status",
        'return 503, str(error), {"Retry-After": "1"}',
        "return 503, str(error), {}",
        ("tests/serve/api/test_http_guard_middleware.py",),
        "clients get no Retry-After on a full queue",
    ),
    Mutation(
        "deadline-retry-after-constant",
        "ldlm.serve.api.errors:error_status",
        '{"Retry-After": str(math.ceil(error.retry_after_s))}',
        '{"Retry-After": "1"}',
        ("tests/serve/api/test_errors_retry_after.py",),
        "a request refused behind queued work is told to retry in 1 s, however long the queue",
    ),
    Mutation(
        "deadline-retry-after-rounded-down",
        "ldlm.serve.api.errors:error_status",
        "str(math.ceil(error.retry_after_s))",
        "str(int(error.retry_after_s))",
        ("tests/serve/api/test_errors_retry_after.py",),
        "a client that retries when told to comes back before the queued work is done, and is refused again",
    ),
    # --- KServe parsing ------------------------------------------------------------------------------
    Mutation(
        "kserve-binary-nan-unchecked",
        "ldlm.serve.api.kserve:_input_tensor",
        'if dtype.kind == "f" and not np.isfinite(array).all():',
        'if dtype.kind == "f" and size is None and not np.isfinite(array).all():',
        ("tests/serve/api/test_kserve_guards.py", "tests/serve/api/test_http_guard.py"),
        "NaN and Infinity in binary tensors reach the graphs",
    ),
    Mutation(
        "kserve-header-length-equal-refused",
        "ldlm.serve.api.kserve:_json_header_size",
        "if not 0 < json_size <= len(body):",
        "if not 0 < json_size < len(body):",
        ("tests/serve/api/test_kserve_guards.py",),
        "a JSON-only body that sends its Inference-Header-Content-Length is refused",
    ),
    Mutation(
        "kserve-rank-limit-off-by-one",
        "ldlm.serve.api.kserve:_input_tensor",
        "or len(shape) > 8:",
        "or len(shape) >= 8:",
        ("tests/serve/api/test_kserve_guards.py",),
        "rank-8 tensors refused",
    ),
    Mutation(
        "kserve-duplicate-input-overwrites",
        "ldlm.serve.api.kserve:infer_request_of",
        "if name in inputs:",
        "if name in raw_inputs:",
        ("tests/serve/api/test_kserve_guards.py",),
        "an input given twice silently keeps the second",
    ),
    # --- the eps probe's math ------------------------------------------------------------------------
    Mutation(
        "eps-budget-halved",
        "ldlm.export.layernorm.cases:float32_budget",
        "return 2 * math.ceil(math.log2(max(n, 2))) + 8",
        "return math.ceil(math.log2(max(n, 2))) + 8",
        ("tests/export/layernorm/test_eps_probe_math.py",),
        "the float32 bound is too tight: correct backends fail the probes",
    ),
    Mutation(
        "implied-eps-without-variance",
        "ldlm.export.layernorm.eps_probe:analyse_outputs",
        "float(np.median(s**2 - (centered**2).mean(axis=1)))",
        "float(np.median(s**2))",
        ("tests/export/layernorm/test_eps_probe_math.py", "tests/export/layernorm/test_eps_probe.py"),
        "the implied eps includes the rows' variance",
    ),
    Mutation(
        "probe-rows-not-centered",
        "ldlm.export.layernorm.eps_probe:probe_rows.unit_row",
        "return (r - r.mean()) / r.std()",
        "return r / r.std()",
        ("tests/export/layernorm/test_eps_probe_math.py",),
        "sweep rows are not zero-mean: the implied eps is off",
    ),
    Mutation(
        "eps-bound-without-mean-term",
        "ldlm.export.layernorm.eps_probe:analyse_outputs",
        "(np.abs(z_ref) + mean_magnitude / sigma)",
        "np.abs(z_ref)",
        ("tests/export/layernorm/test_eps_probe_math.py",),
        "every correct float32 LayerNorm fails the large-mean rows",
    ),
    Mutation(
        "eps-bound-mean-not-magnitude",
        "ldlm.export.layernorm.eps_probe:analyse_outputs",
        "mean_magnitude = np.abs(x64).mean(axis=1, keepdims=True)",
        "mean_magnitude = np.abs(mean)",
        ("tests/export/layernorm/test_eps_probe_math.py",),
        "a correct float32 LayerNorm (torch's) fails where z ~ 0 in rows of mean ~0",
    ),
    Mutation(
        "kserve-unknown-field-ignored",
        "ldlm.serve.api.kserve:infer_request_of",
        '    refuse_unknown_fields(payload, REQUEST_FIELDS, "the request")\n',
        "",
        ("tests/serve/api/test_kserve_guards.py",),
        "a misspelled 'outputs' is ignored and the request runs without it",
    ),
    Mutation(
        "text-too-long-named-as-ids",
        "ldlm.pipeline:LDLMPipeline.text_ids",
        "if len(row) > self.config.max_seq_len:",
        "if False:",
        ("tests/ldlm/test_pipeline.py",),
        "a text too long is named len(ids[i]), not texts[i] with its token count",
    ),
    # --- deployment entry points ---------------------------------------------------------------------
    Mutation(
        "triton-bls-chunks-ignored",
        "ldlm.serve.deploy.triton_generate:BLSGraphs.call",
        "self.max_batch or len(next(iter(inputs.values())))",
        "len(next(iter(inputs.values())))",
        ("tests/serve/deploy/test_triton_generate_guards.py",),
        "N above the graphs' max_batch_size fails every BLS call",
    ),
    Mutation(
        "triton-t-not-reshaped",
        "ldlm.serve.deploy.triton_generate:BLSGraphs.denoise",
        '"t": t.float().numpy().reshape(-1, 1)',
        '"t": t.float().numpy()',
        ("tests/serve/deploy/test_triton_repo.py",),
        "Triton refuses t: config.pbtxt declares dims [1]",
    ),
    Mutation(
        "ray-initial-replicas-from-min",
        "ldlm.serve.deploy.ray_app:RayOptions.deployment_options",
        '"initial_replicas": self.replicas,',
        '"initial_replicas": self.min_replicas,',
        ("tests/serve/deploy/test_triton_generate_guards.py",),
        "an autoscaled deployment starts at min_replicas, not --replicas",
    ),
    Mutation(
        "ray-zero-is-true",
        "ldlm.serve.deploy.ray_app:BOOL_WORDS",
        'BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False}',
        'BOOL_WORDS = {"true": True, "false": False, "1": True, "0": True}',
        ("tests/serve/deploy/test_triton_generate_guards.py",),
        "serve run ... trt_cuda_graphs=0 turns CUDA graphs on",
    ),
    Mutation(
        "ray-zero-replicas",
        "ldlm.serve.deploy.ray_app:RayOptions.__post_init__",
        '"replicas": (self.replicas, 1, 4096)',
        '"replicas": (self.replicas, 0, 4096)',
        ("tests/serve/deploy/test_triton_generate_guards.py",),
        "a deployment of zero replicas is accepted and never answers",
    ),
    # --- Ctrl-C that Python drops (ldlm.interrupts), and the engine build it must stop ----------------
    Mutation(
        "interrupt-not-remembered",
        "ldlm.interrupts:_on_sigint",
        "    _received.set()  # first, so that a dropped KeyboardInterrupt is still known",
        "    pass",
        ("tests/ldlm/test_interrupts.py",),
        "a Ctrl-C dropped inside a weakref callback is forgotten: the export goes on and the server starts",
    ),
    Mutation(
        "dropped-interrupt-printed",
        "ldlm.interrupts:remembered_interrupts.unraisable_hook",
        "        if not (isinstance(unraisable.exc_value, KeyboardInterrupt) and interrupted()):",
        "        if True:",
        ("tests/ldlm/test_interrupts.py",),
        "Ctrl-C prints an 'Exception ignored' traceback before 'interrupted'",
    ),
    Mutation(
        "serve-starts-after-dropped-interrupt",
        "ldlm.serve.api.server:_serve",
        "        raise_if_interrupted()  # Ctrl-C while preparing, dropped by Python where it landed: do not start serving",
        "        pass",
        ("tests/ldlm/test_interrupts.py",),
        "Ctrl-C while `ldlm serve` exports is lost and the server starts anyway",
    ),
    Mutation(
        "free-port-from-the-ephemeral-range",
        "ldlm.serve.deploy.ports:free_port",
        "        port = draw.choice(PORT_RANGE)",
        "        port = draw.choice(range(32768, 61000))",
        ("tests/serve/deploy/test_ports.py",),
        "a server's port is one any outgoing connection may take before the server binds it",
    ),
    Mutation(
        "serve-leaves-its-log-handler",
        "ldlm.serve.api.server:json_log",
        "        log.handlers[:] = handlers",
        "        pass",
        ("tests/serve/api/test_server_log.py",),
        "after serve() returns, every request logged in the process fails on a closed stderr",
    ),
    Mutation(
        "engine-monitor-ignores-interrupt",
        "ldlm.export.engine_builder:BuildProgress.Monitor.step_complete",
        "            return not interrupted()",
        "            return True",
        ("tests/ldlm/test_interrupts.py",),
        "Ctrl-C during an engine build goes on building the whole graph",
    ),
    Mutation(
        "build-interrupts-not-deferred",
        "ldlm.export.engine_builder:build_plan",
        "    with logger.capture() as messages, deferred_interrupts():",
        "    with logger.capture() as messages:",
        ("tests/ldlm/test_interrupts.py",),
        "Ctrl-C during a build prints TensorRT's '[ERROR] Exception caught in log()' trace",
    ),
    Mutation(
        "engine-monitor-only-with-progress",
        "ldlm.export.engine_builder:_build",
        'BuildProgress(trt, onnx_path.stem, progress) if hasattr(trt, "IProgressMonitor") else None',
        'BuildProgress(trt, onnx_path.stem, progress) if progress and hasattr(trt, "IProgressMonitor") else None',
        ("tests/ldlm/test_interrupts.py",),
        "without a progress bar, Ctrl-C during an engine build waits for the whole build",
    ),
    Mutation(
        "interrupt-delivered-forever",
        "ldlm.interrupts:raise_if_interrupted",
        """        _received.clear()
        raise KeyboardInterrupt""",
        "        raise KeyboardInterrupt",
        ("tests/ldlm/test_interrupts.py",),
        "after one Ctrl-C in a notebook, every later engine build stops at once",
    ),
    Mutation(
        "engine-interrupt-reported-as-failure",
        "ldlm.export.engine_builder:build_plan",
        "    raise_if_interrupted()  # a Ctrl-C recorded during the build",
        "    pass  # a Ctrl-C recorded during the build",
        ("tests/ldlm/test_interrupts.py",),
        "Ctrl-C during an engine build is reported as 'TensorRT could not build ... BuildCanceled'",
    ),
    # --- importing a checkpoint ------------------------------------------------------------------------
    Mutation(
        "import-skips-conv1d-transpose",
        "ldlm.importing.key_mapping:rename",
        "out.tensors[target] = tensor.t() if rule.transpose and tensor.dim() == 2 else tensor",
        "out.tensors[target] = tensor",
        ("tests/ldlm/importing/test_importing.py",),
        "Hugging Face's Conv1D weights imported untransposed",
    ),
    Mutation(
        "import-last-rule-wins",
        "ldlm.importing.key_mapping:rename",
        "for r in rules if (m := r.pattern.fullmatch(key))",
        "for r in reversed(rules) if (m := r.pattern.fullmatch(key))",
        ("tests/ldlm/importing/test_importing.py",),
        "a mapping's catch-all rule overrides its specific ones",
    ),
    Mutation(
        "import-allows-every-missing",
        "ldlm.importing.convert:match_model",
        "any(p.match(name) for p in allow_missing)",
        "True",
        ("tests/ldlm/importing/test_importing.py",),
        "an import missing whole components reports success",
    ),
    Mutation(
        "import-ignores-shape",
        "ldlm.importing.convert:match_model",
        "if tensor.shape != want.shape or not tensor.is_floating_point():",
        "if not tensor.is_floating_point():",
        ("tests/ldlm/importing/test_importing.py",),
        "a tensor of the wrong shape is imported",
    ),
    Mutation(
        "import-runs-pickle",
        "ldlm.importing.convert:_read_state_dict",
        'map_location="cpu", weights_only=True',
        'map_location="cpu", weights_only=False',
        ("tests/ldlm/importing/test_importing.py",),
        "a state dict's pickle runs code on import",
    ),
    Mutation(
        "import-ignores-failed-parity",
        "ldlm.importing.convert:check_parity",
        "if not result.passed:",
        "if False:",
        ("tests/ldlm/importing/test_importing.py",),
        "an import whose parity fails reports success",
    ),
    Mutation(
        "import-n-heads-from-wrong-preset",
        "ldlm.importing.config:resolve_config",
        'if "n_heads" not in inferred and "n_heads" not in overrides and values["d_model"] != start.d_model:',
        "if False:",
        ("tests/ldlm/importing/test_importing.py",),
        "n_heads silently taken from a preset of another width",
    ),
    Mutation(
        "import-truncated-gpt2-depth",
        "ldlm.importing.config:resolve_config",
        "Inferred(counted.value - 1 - feature_layer,",
        "Inferred(counted.value,",
        ("tests/ldlm/importing/test_importing.py",),
        "a truncated GPT-2 is read as a shallower one: the wrong feature layer",
    ),
    Mutation(
        "import-n-heads-not-inferred",
        "ldlm.importing.config:infer_fields",
        '_derive(found, "n_heads", HEAD_NORMS, shapes, lambda n: d_model.value // n)',
        "pass",
        ("tests/ldlm/importing/test_importing.py",),
        "our own checkpoints' n_heads is not read from their weights",
    ),
    # --- a new user's refusals: caps, --force, keys, tokenizers, KServe ranges, artifact origin ------------
    Mutation(
        "cli-serve-threads-uncapped",
        "ldlm.cli.serving:_serve_limit_options",
        'type=setting("threads", " threads"),',
        "type=int,",
        ("tests/ldlm/cli/test_cli_ranges.py",),
        "ldlm serve --threads -3 is accepted",
    ),
    Mutation(
        "cli-int-list-cap-off-by-one",
        "ldlm.cli.options:capped_positive_int_list",
        "allowed = Range(1, high)",
        "allowed = Range(1, high + 1)",
        ("tests/ldlm/cli/test_cli_ranges.py",),
        "bench --batches one past the cap runs",
    ),
    Mutation(
        "cli-float-range-either-end",
        "ldlm.cli.options:float_in",
        "if not (above_low and below_high):",
        "if not (above_low or below_high):",
        ("tests/ldlm/cli/test_cli_ranges.py",),
        "a float option above its range is accepted",
    ),
    Mutation(
        "bench-solver-steps-uncapped",
        "ldlm.serve.checks.bench_latency:parse_solver_specs",
        "if int(steps) > MAX_STEPS:",
        "if int(steps) > MAX_STEPS * 1000:",
        ("tests/ldlm/cli/test_cli_ranges.py",),
        "bench --solvers ddim@1000000 runs for hours",
    ),
    Mutation(
        "cli-file-inside-out-accepted",
        "ldlm.cli:refuse_existing_out",
        "if path is not None and Path(out).resolve() in Path(path).resolve().parents:",
        "if False:",
        ("tests/ldlm/cli/test_checks_files.py",),
        "parity --save-inputs inside --out is refused after the run, its case written into the new report directory",
    ),
    Mutation(
        "served-export-unverified",
        "ldlm.export.artifact:check_artifacts",
        "if verify and not _CALLER_VERIFIES.get():",
        "if False:",
        ("tests/export/test_artifact_layer_norms.py",),
        "ldlm serve runs an export whose LayerNorm eps was edited, which verify-onnx rejects",
    ),
    Mutation(
        "export-refuses-late",
        "ldlm.export.onnx_export:export_graphs",
        'refuse_existing(out, overwrite, {"checkpoint": checkpoint}, EXPORT_WRITER)  # before the checkpoint loads',
        "pass",
        ("tests/export/test_onnx_export_force.py",),
        "an unsafe output is refused only after the export",
    ),
    Mutation(
        "serve-blank-key-option",
        "ldlm.cli.serving:api_key",
        "if not option.strip():",
        "if not option:",
        ("tests/ldlm/cli/test_cli_serving.py",),
        "--api-key ' ' serves with a blank key",
    ),
    Mutation(
        "serve-empty-env-key",
        "ldlm.cli.serving:api_key",
        "if key is not None and not key.strip():",
        "if False:",
        ("tests/ldlm/cli/test_cli_serving.py",),
        "an empty LDLM_API_KEY serves with auth off, silently",
    ),
    Mutation(
        "tokenizer-json-traceback",
        "ldlm.model.tokenizer:TextTokenizer.from_directory",
        'raise TokenizerError(f"{file} is not valid tokenizer JSON ({error}); {FIX}") from None',
        "raise",
        ("tests/ldlm/model/test_tokenizer_errors.py",),
        "a corrupted tokenizer.json gives a raw traceback",
    ),
    Mutation(
        "tokenizer-source-unnamed",
        "ldlm.model.tokenizer:TextTokenizer.from_directory",
        "return cls(tokenizer, str(file))",
        "return cls(tokenizer)",
        ("tests/ldlm/model/test_tokenizer_errors.py",),
        "tokenizer errors do not name the file",
    ),
    Mutation(
        "kserve-t-above-one",
        "ldlm.serve.api.routes.kserve:check_values",
        "outside = np.flatnonzero((times < 0) | (times > 1))",
        "outside = np.flatnonzero(times < 0)",
        ("tests/serve/api/test_kserve_ranges.py",),
        "a denoiser request with t = 5 is answered with garbage",
    ),
    Mutation(
        "kserve-empty-mask-row-axis",
        "ldlm.serve.api.routes.kserve:check_values",
        "~array.any(axis=1)",
        "~array.any(axis=0)",
        ("tests/serve/api/test_kserve_ranges.py",),
        "a row with no real position is accepted",
    ),
    Mutation(
        "kserve-values-unchecked",
        "ldlm.serve.api.routes.kserve:check_infer_inputs",
        "check_values(model, name, array)",
        "pass",
        ("tests/serve/api/test_kserve_ranges.py",),
        "KServe inputs out of range reach the graphs",
    ),
    Mutation(
        "origin-check-always-fails",
        "ldlm.export.artifact:check_from_checkpoint",
        "if value == actual:",
        "if value != actual or value == actual:",
        ("tests/export/test_artifact_origin.py",),
        "parity refuses the export of its own checkpoint",
    ),
    Mutation(
        "parity-origin-unchecked",
        "ldlm.serve.checks.parity:run_parity",
        "check_from_checkpoint(checkpoint, source)  # before the checkpoint loads",
        "pass",
        ("tests/export/test_artifact_origin.py",),
        "parity of another checkpoint's export reports 0% with no hint",
    ),
    Mutation(
        "eps-probe-origin-unchecked",
        "ldlm.serve.checks.eps_probe_artifact:probe_layer_norm_eps",
        "check_from_checkpoint(checkpoint, directory)",
        "pass",
        ("tests/export/test_artifact_origin.py",),
        "probe-eps of another checkpoint's export runs unexplained",
    ),
    Mutation(
        "engine-dir-not-recognised",
        "ldlm.export.artifact:read_manifest",
        "if plans:",
        "if False:",
        ("tests/export/test_artifact_kind.py",),
        "serve ENGINES --backend ort says only 'no manifest.json'",
    ),
    Mutation(
        "export-dir-given-to-trt",
        "ldlm.export.artifact:check_engine_dir",
        "if (directory / MANIFEST_FILE).is_file() and not built_plans(directory):",
        "if False:",
        ("tests/export/test_artifact_kind.py",),
        "an export given as engines is not named as one",
    ),
    # --- streamed previews and prompted generation ------------------------------------------------------
    Mutation(
        "prompted-length-adds-the-prompt",
        "ldlm.serve.api.schemas:GenerateFields.to_request",
        "return self.sampling_request(fields.n, fields.length, fields.seed)",
        "return self.sampling_request(fields.n, fields.length + 4, fields.seed)",
        ("tests/serve/api/test_prompted.py", "tests/e2e/test_request_plan_matrix.py"),
        "length means the tokens after the prompt over HTTP and the whole sample on the CLI",
    ),
    # --- token sampling at the decoder (temperature, top_p, logprobs) --------------------------------------
    Mutation(
        "nucleus-drops-its-last-token",
        "ldlm.sampling.tokens:sample_tokens",
        "before = sorted_probs.cumsum(dim=-1) - sorted_probs",
        "before = sorted_probs.cumsum(dim=-1)",
        ("tests/ldlm/sampling/test_tokens.py",),
        "top_p keeps one token too few",
    ),
    Mutation(
        "temperature-ignored",
        "ldlm.sampling.tokens:sample_tokens",
        "logits.float().reshape(b * length, v) / temperature",
        "logits.float().reshape(b * length, v)",
        ("tests/ldlm/sampling/test_tokens.py",),
        "every temperature samples at 1",
    ),
    Mutation(
        "temperature-zero-samples",
        "ldlm.sampling.tokens:sample_tokens",
        "return logits.argmax(dim=-1)  # step 1",
        "return logits.float().softmax(-1).multinomial(1).reshape(logits.shape[:-1])",
        ("tests/ldlm/sampling/test_tokens.py",),
        "temperature 0 is not the argmax",
    ),
    Mutation(
        "logprobs-not-normalized",
        "ldlm.sampling.tokens:token_logprobs",
        "logp = torch.log_softmax(logits.float(), dim=-1)",
        "logp = logits.float() - logits.float().amax(-1, keepdim=True)",
        ("tests/ldlm/sampling/test_tokens.py",),
        "log-probabilities that do not sum to one",
    ),
    Mutation(
        "token-draw-ignores-seed",
        "ldlm.sampling.tokens:choose_tokens",
        "torch.Generator().manual_seed(sampling.seed)",
        "torch.Generator().manual_seed(0)",
        ("tests/ldlm/sampling/test_tokens.py",),
        "every seed draws the same tokens",
    ),
    Mutation(
        "sampled-decode-sees-padding",
        "ldlm.pipeline:LDLMPipeline.decode",
        "choose_tokens(decode_logits(latents, mask)[:, :length], sampling)",
        "choose_tokens(decode_logits(latents, mask), sampling)",
        ("tests/ldlm/sampling/test_tokens.py",),
        "a sampled text depends on its length bucket",
    ),
    Mutation(
        "logits-check-only-temperature",
        "ldlm.serve.api.openai_schemas:token_sampling",
        "if sampling.needs_logits and not has_logits:",
        "if sampling.temperature > 0 and not has_logits:",
        ("tests/serve/api/routes/test_openai.py",),
        "logprobs on an export without logits fails inside",
    ),
    Mutation(
        "logits-assumed",
        "ldlm.serve.api.routes.openai:Completions.prepare",
        'has_logits = getattr(self.pipeline.graphs, "has_logits", True)',
        "has_logits = True",
        ("tests/serve/api/routes/test_openai.py",),
        "an export without logits fails inside instead of naming the fix",
    ),
    Mutation(
        "rdata-na-string-read-as-empty",
        "ldlm.training.rdata:_Reader.item",
        'return None if n == -1 else self.take(n).decode("utf-8", errors="replace")',
        'return "" if n == -1 else self.take(n).decode("utf-8", errors="replace")',
        ("tests/ldlm/training/test_rdata.py",),
        "R's NA strings come back as empty text",
    ),
    Mutation(
        "corpus-held-out-leaks-into-training",
        "ldlm.training.corpus:load_corpus",
        "train += ids[:cut] + [eos]",
        "train += ids + [eos]",
        ("tests/ldlm/training/test_corpus.py",),
        "the held-out end of every document is trained on too",
    ),
    Mutation(
        "checksums-not-compared",
        "ldlm.model.checkpoint:check_checksums",
        "if found != expected:",
        "if found != expected and False:",
        ("tests/ldlm/model/test_checkpoint.py",),
        "a corrupted checkpoint file loads",
    ),
    Mutation(
        "unseen-ids-not-sealed",
        "ldlm.training.objectives:VocabularyHead.seal",
        "full.bias[unseen] = UNSEEN_LOGIT",
        "full.bias[unseen] = 0.0",
        ("tests/ldlm/training/test_objectives.py",),
        "ids the corpus never has can win the argmax",
    ),
    Mutation(
        "last-token-weight-ignored",
        "ldlm.training.objectives:decoding_loss",
        'token_loss = (weights * F.cross_entropy(logits, targets, reduction="none")).sum() / weights.sum()',
        "token_loss = F.cross_entropy(logits, targets)",
        ("tests/ldlm/training/test_objectives.py",),
        "a window's last token weighs no more than any other, so a token kept in the next latent is lost where a window ends",
    ),
    Mutation(
        "tuning-worst-is-the-mean",
        "ldlm.training.grid_search:Tuner.objective_of",
        "return float((distance / size).max())",
        "return float((distance / size).mean())",
        ("tests/ldlm/training/test_grid_search.py",),
        "the search averages over the tuning samples, so a grid that throws one sample off can win",
    ),
    Mutation(
        "tuning-validated-on-the-tuning-seed",
        "ldlm.training.grid_search:grid_with_scores",
        "validation = tuner.samples(s.validation_seed, s.tune_n, s.tune_length)",
        "validation = tuner.samples(s.tune_seed, s.tune_n, s.tune_length)",
        ("tests/ldlm/training/test_grid_search.py",),
        "the grids are validated on the samples they were searched on, so an overfit grid is kept",
    ),
    Mutation(
        "tuning-keeps-the-last-candidate",
        "ldlm.training.grid_search:grid_with_scores",
        "kept = min(validated, key=validated.__getitem__)",
        "kept = list(validated)[-1]",
        ("tests/ldlm/training/test_grid_search.py",),
        "the searched grid is kept even where validation finds it worse than the default grid",
    ),
    Mutation(
        "tuning-power-scan-takes-the-worst",
        "ldlm.training.grid_search:tune_grid",
        "rho = min(scores, key=scores.__getitem__)",
        "rho = max(scores, key=scores.__getitem__)",
        ("tests/ldlm/training/test_grid_search.py",),
        "the search starts from the worst power grid",
    ),
    Mutation(
        "tuning-objective-ignored",
        "ldlm.training.grid_search:Tuner.objective_of",
        'if self.settings.objective == "pooled":',
        "if False:",
        ("tests/ldlm/training/test_grid_search.py",),
        "the pooled objective (the default) searches the worst sample's error",
    ),
    Mutation(
        "feature-loss-dropped",
        "ldlm.training.objectives:decoding_loss",
        "return token_loss + plan.feature_weight * feature_loss, stats",
        "return token_loss, stats",
        ("tests/ldlm/training/test_objectives.py",),
        "the latent decoder is no longer trained toward GPT-2's features",
    ),
    Mutation(
        "decoder-stage-grads-reach-the-encoder",
        "ldlm.training.objectives:decoder_loss",
        "with torch.no_grad():",
        "with torch.enable_grad():",
        ("tests/ldlm/training/test_objectives.py",),
        "the decoder stage's gradients reach the encoder and the denoiser, whose latents the others were trained on",
    ),
    Mutation(
        "decoder-stage-decodes-undenoised-latents",
        "ldlm.training.objectives:decoder_loss",
        "latents = self_conditioned_x0(model, x_t, t, mask) * model.latent_std + model.latent_mean",
        "latents = latents",
        ("tests/ldlm/training/test_objectives.py",),
        "the decoders never see a denoiser's latents, and samples keep their word pieces",
    ),
    Mutation(
        "resume-forgets-the-optimizer",
        "ldlm.training.run:Run.optimize",
        "optimizer.load_state_dict(self.optimizer_state)",
        "pass",
        ("tests/ldlm/training/test_run.py",),
        "a resumed run restarts Adam's moments",
    ),
    Mutation(
        "qdq-on-layernorm-allowed",
        "ldlm.export.layernorm.verify_quantized:check_quantized_layer_norms",
        "if made_by is not None and made_by.op_type in QDQ_OPS:",
        "if False:",
        ("tests/export/test_quantize.py",),
        "a Q/DQ pair on a LayerNorm's scale is not named",
    ),
    Mutation(
        "int8-claim-unchecked",
        "ldlm.export.layernorm.verify_quantized:check_precision_claim",
        'if precision == "int8" and not found:',
        'if precision == "int8" and not found and False:',
        ("tests/export/test_quantize.py",),
        "an fp32 file passes as the int8 variant",
    ),
    Mutation(
        "variant-files-unhashed",
        "ldlm.export.artifact:check_artifacts",
        'for name, record in variant.get("files", {}).items():',
        "for name, record in {}.items():",
        ("tests/export/test_quantize.py",),
        "an edited int8 variant is served",
    ),
    Mutation(
        "variants-not-probed",
        "ldlm.export.layernorm.eps_probe_ort:probe_onnx_export",
        'for precision, variant in entry.get("variants", {}).items()',
        "for precision, variant in {}.items()",
        ("tests/export/test_quantize.py", "tests/serve/checks/test_parity_int8.py"),
        "the int8 variant's LayerNorms are never probed",
    ),
    Mutation(
        "int8-floor-keeps-the-wrong-nodes",
        "ldlm.export.quantize:quantize_int8",
        "for node in sorted(candidates, key=errors.__getitem__):",
        "for node in sorted(candidates, key=lambda n: -errors[n]):",
        ("tests/export/test_quantize.py",),
        "the int8 variant quantizes the nodes that hurt most and keeps the harmless ones float",
    ),
    Mutation(
        "int8-floor-ignored",
        "ldlm.export.quantize:quantize_int8",
        "if floor is None or floor.min_cosine == 0:",
        "if True:",
        ("tests/export/test_quantize.py",),
        "an int8 denoiser below its accuracy floor is shipped",
    ),
    Mutation(
        "cosine-bound-ignored",
        "ldlm.export.layernorm.compare:compare_outputs",
        "passed=bool(not failing.any() and cos.min() >= cosine_at_least),",
        "passed=bool(not failing.any()),",
        ("tests/export/layernorm/test_compare.py",),
        "int8 outputs pointing elsewhere pass",
    ),
    Mutation(
        "int8-serves-fp32",
        "ldlm.serve.runtime.ort_backend:open_backend",
        'session(path / v["file"], g, "int8") if v else session(files[g], g)',
        'session(files[g], g, "int8") if v else session(files[g], g)',
        ("tests/export/test_quantize.py", "tests/serve/checks/test_parity_int8.py"),
        "--precision int8 runs the fp32 graphs",
    ),
    Mutation(
        "echo-logprobs-of-the-decoded-tokens",
        "ldlm.sampling.tokens:choose_tokens",
        "ids[:, : len(sampling.given)] = torch.tensor(sampling.given, dtype=ids.dtype)",
        "pass",
        ("tests/ldlm/sampling/test_tokens.py",),
        "echo + logprobs reports the prompt positions' decoded tokens, not the prompt's",
    ),
    Mutation(
        "qdq-asymmetric-zero-point-passes",
        "ldlm.export.layernorm.verify_quantized:check_qdq_zero_points",
        "elif numpy_helper.to_array(zero_point).astype(np.float32).any():",
        "elif numpy_helper.to_array(zero_point).astype(np.float32).all():",
        ("tests/export/test_qdq.py",),
        "a Q/DQ graph with a nonzero zero point in one channel goes to TensorRT, which supports only symmetric ones",
    ),
    Mutation(
        "qdq-quantizes-the-float-modules",
        "ldlm.export.qdq:write_qdq",
        "nodes_to_exclude=keep,",
        "nodes_to_exclude=[],",
        ("tests/export/test_qdq.py",),
        "the time embedding and the vocabulary head get Q/DQ",
    ),
    Mutation(
        "calibration-records-x0-prev-as-x-t",
        "ldlm.export.calibration:denoiser_feeds",
        '"x_t": _array(x_t, np.float32),',
        '"x_t": _array(x0_prev, np.float32),',
        ("tests/export/test_calibration.py",),
        "the denoiser is calibrated on the wrong activations",
    ),
    Mutation(
        "gpu-target-default-sample-loose",
        "scripts.research.gpu_targets:TARGETS",
        "lambda v: v <= 40,",
        "lambda v: v <= 40.02,",
        ("tests/tools/test_gpu_check.py",),
        "a 1024-token sample at the default steps that misses 40 ms is reported met",
    ),
    Mutation(
        "server-socket-without-tcp-proto",
        "ldlm.serve.api.server:bind_socket",
        "socket.SOCK_STREAM, socket.IPPROTO_TCP)",
        "socket.SOCK_STREAM)",
        ("tests/serve/api/test_server_nodelay.py",),
        "every response with a body waits about 40 ms for the client's delayed ACK (Nagle left on)",
    ),
    Mutation(
        "inductor-never-compiles",
        "ldlm.serve.runtime.torch_backends:InductorBackend.compile",
        "return cast(nn.Module, torch.compile(module, dynamic=False))",
        "return module",
        ("tests/serve/runtime/test_torch_backends_inductor.py",),
        "--backend inductor serves the compiled backend's unfused kernels under Inductor's name",
    ),
    Mutation(
        "inductor-recompile-limit-kept",
        "ldlm.serve.runtime.torch_backends:InductorBackend.compile",
        "torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, buckets)",
        "pass",
        ("tests/serve/runtime/test_torch_backends_inductor.py",),
        "past the eighth bucket the inductor backend silently runs eagerly",
    ),
    # --- the export cache: its key and the check of an entry at every start ------------------------------
    Mutation(
        "export-key-drops-tokenizer",
        "ldlm.serve.api.export_cache:export_key",
        "for name in (TOKENIZER_FILE, SCHEDULES_FILE)",
        "for name in (SCHEDULES_FILE,)",
        ("tests/serve/api/test_service_export_cache.py::test_a_checkpoint_with_another_tokenizer_gets_its_own_entry",),
        "a checkpoint given another tokenizer is served the cached export made with the old one",
    ),
    Mutation(
        "export-key-drops-tuned-grids",
        "ldlm.serve.api.export_cache:export_key",
        "for name in (TOKENIZER_FILE, SCHEDULES_FILE)",
        "for name in (TOKENIZER_FILE,)",
        ("tests/serve/api/test_service_export_cache.py::test_a_retuned_checkpoint_is_served_its_new_grids",),
        "a re-tuned checkpoint (new schedules.json, same weights) is served its cached export with the old grids",
    ),
    Mutation(
        "export-cache-trusts-cached-grids",
        "ldlm.serve.api.export_cache:entry_problem",
        "        read_schedules(entry)\n",
        "",
        ("tests/serve/api/test_service_export_cache.py::test_a_tampered_cached_schedules_json_is_exported_again_never_served",),
        "a cached export whose schedules.json was edited is reused as verified",
    ),
    # --- one plan per request, one table of ranges, one registry of backends ------------------------------
    Mutation(
        "http-body-fills-in-steps",
        "ldlm.serve.api.schemas:SamplingBody.sampling_request",
        "n, length, fields.steps, seed, fields.sampler,",
        "n, length, fields.steps or 5, seed, fields.sampler,",
        ("tests/e2e/test_request_plan_matrix.py",),
        "a request naming no steps runs another plan over HTTP than from the CLI",
    ),
    Mutation(
        "answer-names-no-plan",
        "ldlm.serve.api.streaming:ran",
        "return None if result.plan is None else result.plan.summary()",
        "return None",
        ("tests/serve/api/test_prompted.py", "tests/e2e/test_request_plan_matrix.py"),
        "/v1/generate's answer no longer says which sampler, steps and grid ran",
    ),
    Mutation(
        "default-steps-cut-to-the-cap",
        "ldlm.sampling.request:_default_steps",
        "    if limits.max_steps is not None and steps > limits.max_steps:",
        "    if False:",
        ("tests/serve/deploy/test_triton_generate_guards.py",),
        "a default above the server's max_steps is refused as if the client had asked for it",
    ),
    Mutation(
        "top-logprobs-cap-narrowed",
        "ldlm.limits:MAX_TOP_LOGPROBS",
        "MAX_TOP_LOGPROBS = 5",
        "MAX_TOP_LOGPROBS = 4",
        ("tests/e2e/test_bounds_every_path.py",),
        "a completion asking for OpenAI's 5 log-probability alternatives is refused",
    ),
    Mutation(
        "cli-integer-refusal-names-one-end",
        "ldlm.cli.options:int_in",
        "raise argparse.ArgumentTypeError(allowed.refusal(str(value), why))",
        'raise argparse.ArgumentTypeError(f"{value} is out of range; allowed: an integer >= {low}")',
        ("tests/e2e/test_bounds_every_path.py",),
        "ldlm generate --n 0 says >= 1, and --n 65 says >= 1 too: the user never learns the cap",
    ),
    Mutation(
        "bench-times-torch-in-fp32-on-cuda",
        "ldlm.cli.bench:_cmd_bench",
        "precision=resolve_run(args.device, REFERENCE_BACKEND, args.precision)[1],",
        'precision=args.precision or "fp32",',
        ("tests/serve/runtime/test_registry_resolution.py",),
        "ldlm bench --device cuda times the torch backends in fp32, not the fp16 that ldlm serve runs there",
    ),
    Mutation(
        "parity-checks-the-cpu-default-on-cuda",
        "ldlm.cli.checks:_cmd_parity",
        "resolve_run(args.device, args.backend, args.precision)",
        'resolve_run("cpu", args.backend, args.precision)',
        ("tests/serve/runtime/test_registry_resolution.py",),
        "ldlm parity --device cuda checks ONNX Runtime in fp32 on the CPU, not the inductor fp16 that ldlm serve runs there",
    ),
    Mutation(
        "body-field-bound-from-a-literal",
        "ldlm.serve.api.openai_schemas:DECODING_FIELDS",
        "ranged(TOP_P, None,",
        "ranged(TEMPERATURE, None,",
        ("tests/ldlm/test_limits.py",),
        "top_p 0.95 refused over HTTP though the token sampler takes it",
    ),
    Mutation(
        "ort-cuda-runs-on-the-cpu",
        "ldlm.serve.runtime.registry:REGISTRY",
        'providers=("CUDAExecutionProvider", CPU_PROVIDER),',
        "providers=(CPU_PROVIDER,),",
        ("tests/serve/runtime/test_registry.py",),
        "--backend ort-cuda serves on the CPU without a word",
    ),
    Mutation(
        "backend-precision-unchecked",
        "ldlm.serve.runtime.backends:open_graphs",
        "    if precision not in info.precisions:",
        "    if False:",
        ("tests/serve/runtime/test_backends.py",),
        "ort asked for bf16 fails deep in ONNX Runtime instead of naming the precisions it runs",
    ),
)
# the entries that pin the docs' promises, kept with the map of promise to entry (tests/tools/mutation_promises.py)
MUTATIONS += tuple(Mutation(*fields) for fields in PROMISE_MUTATIONS)


def repository_files(root: Path) -> list[str]:
    """Tracked and untracked-but-not-ignored files: what the scratch copy needs, without .venv."""
    listing = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=root, check=True, capture_output=True).stdout
    return sorted(p for p in listing.decode().split("\0") if p and (root / p).is_file())


def copy_repository(root: Path, dst: Path) -> None:
    if dst.exists():
        shutil.rmtree(dst)
    for rel in repository_files(root):
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, target)


def scratch_venv(root: Path, work: Path, repo: Path) -> Path:
    """A venv that sees this checkout's dependencies and imports ldlm from the scratch copy."""
    venv = work / "venv"
    python = venv / "bin" / "python"
    # Every site-packages the checkout's python sees, in its order: its own, and those it reaches
    # through .pth lines (a worktree's venv that borrows another checkout's dependencies), which a
    # .pth line in the scratch venv would not follow by itself.
    probe = "import sys; print('\\n'.join(p for p in sys.path if p.endswith('site-packages')))"
    deps = subprocess.run([str(root / ".venv" / "bin" / "python"), "-c", probe], check=True, capture_output=True, text=True).stdout.strip()
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)  # pip and setuptools come from .venv
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True, capture_output=True, text=True
    ).stdout.strip()
    (Path(purelib) / "ldlm_dependencies.pth").write_text(deps + "\n")  # every run: a reused venv follows this checkout's .venv
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index", "-e", str(repo)],
        check=True,
        capture_output=True,
    )
    probe = "import ldlm, ldlm.serve.runtime.scheduler as s, ldlm.export.layernorm.verify as v; print(ldlm.__file__); print(s.__file__); print(v.__file__)"
    where = subprocess.run([str(python), "-c", probe], cwd=work, check=True, capture_output=True, text=True).stdout.split()
    if not all(Path(p).resolve().is_relative_to(repo.resolve()) for p in where):
        raise SystemExit(f"the scratch venv imports ldlm from {where}, not from the scratch copy {repo}")
    return python


def run_pytest(python: Path, repo: Path, args: list[str], timeout_s: float) -> tuple[str, float, list[str], str]:
    """('passed' | 'failed' | 'error' | 'timeout', seconds, failing test ids, output tail)."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # a reverted file must never meet a stale .pyc
    started = time.perf_counter()
    try:
        done = subprocess.run(
            [str(python), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired as expired:
        out = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else (expired.stdout or "")
        return "timeout", time.perf_counter() - started, [], out[-2000:]
    seconds = time.perf_counter() - started
    output = done.stdout + done.stderr
    status = {0: "passed", 1: "failed"}.get(done.returncode, "error")
    return status, seconds, failing_tests(output), output[-2000:]


# pytest's short summary names a failing test as "FAILED tests/x.py::test - why" (an error in collection or a
# fixture: "ERROR tests/x.py..."); a captured log record at level ERROR ("ERROR    logger:file.py:12 ...") is not one.
SUMMARY_LINE = re.compile(r"^(?:FAILED|ERROR) (tests/\S+)")


def failing_tests(output: str) -> list[str]:
    """The test ids of pytest's short summary lines in ``output``."""
    return [match.group(1) for line in output.splitlines() if (match := SUMMARY_LINE.match(line))]


DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
# Statements whose bodies still belong to the scope around them (a definition under `if` or `try`).
BLOCKS = (
    ast.If,
    ast.For,
    ast.AsyncFor,
    ast.While,
    ast.With,
    ast.AsyncWith,
    ast.Try,
    ast.TryStar,
    ast.Match,
    ast.ExceptHandler,
    ast.match_case,
)


class StaleMutationError(Exception):
    """A mutation whose target is gone, or whose ``old`` text does not occur exactly once in it."""


def package_dirs(root: Path) -> dict[str, str]:
    """pyproject's package-dir mapping (``ldlm.serve`` -> ``serve``): where the installed packages' sources lie."""
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        return {}
    return dict(tomllib.loads(pyproject.read_text()).get("tool", {}).get("setuptools", {}).get("package-dir", {}))


def module_file(root: Path, module: str) -> Path:
    """``module``'s source file under ``root`` (``ldlm.serve.api.kserve`` -> ``serve/api/kserve.py``)."""
    mapping = package_dirs(root)
    parts = module.split(".")
    base = root.joinpath(*parts)
    for i in range(len(parts), 0, -1):  # the longest mapped package wins
        if ".".join(parts[:i]) in mapping:
            base = root.joinpath(mapping[".".join(parts[:i])], *parts[i:])
            break
    package = base / "__init__.py"
    return package if package.is_file() else base.with_name(base.name + ".py")


def assigned_names(node: ast.stmt) -> set[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    names = set()
    for target in targets:
        for part in target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]:
            if isinstance(part, ast.Name):
                names.add(part.id)
    return names


def named_in(scope: ast.AST, name: str) -> list[ast.stmt]:
    """What ``scope`` defines as ``name``: functions and classes, and in a module or class body assignments too."""
    found: list[ast.stmt] = []
    pending = list(ast.iter_child_nodes(scope))
    while pending:
        node = pending.pop(0)
        if isinstance(node, DEFINITIONS):
            found += [node] if node.name == name else []
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            found += [node] if name in assigned_names(node) and isinstance(scope, (ast.Module, ast.ClassDef)) else []
        elif isinstance(node, BLOCKS):
            pending += list(ast.iter_child_nodes(node))
    return found


def target_span(root: Path, target: str) -> tuple[Path, str, int, int]:
    """(file, its text, start, end): the characters of ``target``'s source, whole lines, decorators included."""
    if ":" not in target:
        if target.endswith(".py"):
            raise StaleMutationError("a Python file is named by module and name (module:qualname), not by its path")
        path = root / target
        if not path.is_file():
            raise StaleMutationError(f"{target} does not exist")
        text = path.read_text()
        return path, text, 0, len(text)
    module, qualname = target.split(":", 1)
    path = module_file(root, module)
    where = path.relative_to(root)
    if not path.is_file():
        raise StaleMutationError(f"module file {where} does not exist")
    text = path.read_text()
    try:
        scopes: list[ast.AST] = [ast.parse(text, str(where))]
    except SyntaxError as error:
        raise StaleMutationError(f"{where} does not parse: {error}") from None
    found: list[ast.stmt] = []
    for part in qualname.split("."):
        found = [node for scope in scopes for node in named_in(scope, part)]
        scopes = list(found)
    if len(found) != 1:
        raise StaleMutationError(f"{where} defines {qualname} {len(found)} times; it must define it once")
    node = found[0]
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    lines = text.splitlines(keepends=True)
    start = len("".join(lines[: first - 1]))
    return path, text, start, start + len("".join(lines[first - 1 : node.end_lineno]))


def locate(root: Path, m: Mutation) -> tuple[Path, str, int, int]:
    """``target_span`` of ``m``'s target, checked: ``m.old`` occurs exactly once in it."""
    path, text, start, end = target_span(root, m.target)
    count = text.count(m.old, start, end)
    if count != 1:
        lines = f"lines {text.count(chr(10), 0, start) + 1}-{text.count(chr(10), 0, end)}"
        raise StaleMutationError(f"{m.old!r} occurs {count} times in it ({path.relative_to(root)}, {lines}); it must occur once")
    return path, text, start, end


def mutated(text: str, start: int, end: int, m: Mutation) -> str:
    """``text`` with ``m``'s bug planted inside its target's span only."""
    return text[:start] + text[start:end].replace(m.old, m.new, 1) + text[end:]


def check_mutations(root: Path, mutations: tuple[Mutation, ...]) -> None:
    problems = []
    for m in mutations:
        try:
            locate(root, m)
        except StaleMutationError as error:
            problems.append(f"{m.id}: {m.target}: {error}")
        for test in m.tests:
            file, _, names = test.partition("::")
            if file == LIST_TEST:
                problems.append(f"{m.id}: names {LIST_TEST}, which would catch any edit; name a behaviour test")
            if not (root / file).is_file():
                problems.append(f"{m.id}: test file {file} does not exist")
            elif names and not defines_test(root / file, names):
                problems.append(f"{m.id}: {file} defines no test {names}")
    ids = [m.id for m in mutations]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        problems.append(f"mutation ids are not unique: {', '.join(repeated)}")
    if problems:
        raise SystemExit("mutation list is stale:\n  " + "\n  ".join(problems))


def defines_test(file: Path, names: str) -> bool:
    """Whether ``file`` defines the test a node id names after its file (``test_x``, ``Class::test_x``,
    ``test_x[param]``): each part, parameters aside, as a def or a class."""
    text = file.read_text()
    parts = [part.split("[", 1)[0] for part in names.split("::")]
    return all(re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{re.escape(part)}\b", text, re.MULTILINE) for part in parts)


def named_files(m: Mutation) -> set[str]:
    """The files of ``m``'s named tests (a node id by its file)."""
    return {test.split("::", 1)[0] for test in m.tests}


def mirror_of(root: Path, target: str) -> tuple[str, str] | None:
    """(folder, stem) of the test files that mirror ``target``'s module, ``tests/<its folder>/<stem>[_<aspect>].py``
    (``ldlm.serve.api.export_cache:f`` -> ("tests/serve/api", "test_export_cache"); a package, by its
    __init__.py, by the package's name); None for a target that is not a Python module's."""
    if ":" not in target:
        return None
    path = module_file(root, target.split(":", 1)[0]).relative_to(root)
    name = path.parent.name if path.name == "__init__.py" else path.stem
    return (Path("tests", path.parent).as_posix(), f"test_{name}")


def tests_the_module(root: Path, m: Mutation, node_id: str) -> bool:
    """Whether the failing test ``node_id`` (``tests/x/test_y.py::test_z[...]``) tests ``m``'s module: a test
    in the file of one of ``m``'s named tests, or in a file that mirrors its module."""
    file = node_id.split("::", 1)[0]
    if file in named_files(m):
        return True
    mirror = mirror_of(root, m.target)
    if mirror is None:
        return False
    folder, stem = mirror
    path = Path(file)
    return path.parent.as_posix() == folder and path.suffix == ".py" and (path.stem == stem or path.stem.startswith(stem + "_"))


def verdict(root: Path, m: Mutation, stage: str, status: str, failing: list[str]) -> tuple[str, str | None]:
    """(caught | caught elsewhere | survived, what caught it: a failing test's node id, else the run's status).
    In the named tests' run anything that fails is a named test's; in the rest of the suite a failure
    counts as caught only in a test of the mutated module, the first such, and else names the first failure."""
    if status == "passed":
        return SURVIVED, None
    if stage == NAMED_STAGE:
        return CAUGHT, failing[0] if failing else status
    own = [node for node in failing if tests_the_module(root, m, node)]
    if own:
        return CAUGHT, own[0]
    return CAUGHT_ELSEWHERE, failing[0] if failing else f"{status} ({REST_STAGE})"


def tally(results: list[dict]) -> dict[str, int]:
    """How many results each verdict has."""
    verdicts = [r["verdict"] for r in results]
    return {"caught": verdicts.count(CAUGHT), "caught_elsewhere": verdicts.count(CAUGHT_ELSEWHERE), "survived": verdicts.count(SURVIVED)}


def write_report(out: Path, results: list[dict], quick: bool) -> None:
    """The JSON report, rewritten after every mutation (temporary file, then rename). "caught" counts only
    the mutations a test of their own module caught; "caught_elsewhere" those only another test noticed."""
    report = {
        "mutations": len(results),
        **tally(results),
        "quick": quick,
        "set_aside": LIST_TEST,
        "results": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, tuple[Mutation, ...]]:
    """The options, and the mutations ``--only`` selects (all by default)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated mutation ids (default: all)")
    parser.add_argument("--quick", action="store_true", help="run only each mutation's named test files, not the rest of the suite")
    parser.add_argument("--skip-baseline", action="store_true", help="do not first check that the named tests pass unmutated")
    parser.add_argument("--work", default="/tmp/ldlm-mutation-check", help="scratch directory (default: /tmp/ldlm-mutation-check)")
    parser.add_argument(
        "--out", default="runs/mutation_check.json", help="JSON report (default: runs/mutation_check.json, under the repository root)"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=1800, help="per pytest run; a named tests' run past it counts as caught (default: 1800)"
    )
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers for the rest of the suite (default: 2; 1: none)")
    parser.add_argument("--resume", action="store_true", help="keep the results already in --out and run only the others")
    args = parser.parse_args(argv)
    if not args.only:
        return args, MUTATIONS
    wanted = args.only.split(",")
    unknown = sorted(set(wanted) - {m.id for m in MUTATIONS})
    if unknown:
        parser.error(f"--only {','.join(unknown)}: unknown; allowed: {', '.join(m.id for m in MUTATIONS)}")
    return args, tuple(m for m in MUTATIONS if m.id in wanted)


def run_mutation(python: Path, repo: Path, m: Mutation, args: argparse.Namespace) -> dict:
    """``m`` planted in the scratch copy, its named tests run, then (unless --quick, and only if they pass)
    the rest of the suite, and the copy restored: the result as the report records it."""
    workers = ["-n", str(args.workers), "--dist", "loadfile"] if args.workers > 1 else []  # as scripts/test.sh runs the suite
    path, original, start, end = locate(repo, m)
    path.write_text(mutated(original, start, end, m))
    try:
        status, seconds, failing, tail = run_pytest(python, repo, list(m.tests), args.timeout_s)
        stage = NAMED_STAGE
        if status == "passed" and not args.quick:
            # the named tests ran already: a named file is left out, a named test deselected (its file's others run)
            named = [f"--deselect={t}" if "::" in t else f"--ignore={t}" for t in m.tests]
            rest = ["tests", f"--ignore={LIST_TEST}", *named, *workers]
            status, more, failing, tail = run_pytest(python, repo, rest, args.timeout_s)
            seconds += more
            stage = REST_STAGE
    finally:
        path.write_text(original)
    found, by = verdict(repo, m, stage, status, failing)
    return {
        **asdict(m),
        "file": str(path.relative_to(repo)),
        "caught": found == CAUGHT,  # by a test of the mutated module only
        "verdict": found,
        "caught_by": by,
        "status": status,
        "stage": stage,
        "seconds": round(seconds, 1),
        "failing_tests": failing[:5],
        "output_tail": "" if found != SURVIVED and failing else tail[-600:],
    }


def print_table(results: list[dict], out: Path) -> None:
    print(f"\n{'mutation':38s} {'target':60s} {'result':16s} {'s':>6s}  caught by")
    for r in results:
        shown = SURVIVED.upper() if r["verdict"] == SURVIVED else r["verdict"]
        print(f"{r['id']:38s} {r['target']:60s} {shown:16s} {r['seconds']:6.0f}  {r['caught_by'] or ''}")
    counts = tally(results)
    print(
        f"\n{counts['caught']}/{len(results)} caught, {counts['caught_elsewhere']} caught elsewhere, {counts['survived']} survived; report: {out}"
    )


def main(argv: list[str] | None = None) -> int:
    args, mutations = parse_args(argv)
    if args.list:
        for m in mutations:
            print(f"{m.id:38s} {m.target:60s} {m.bug}")
        return 0
    check_mutations(ROOT, mutations)

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    repo = work / "repo"
    print(f"copying {ROOT} to {repo} and installing it into {work / 'venv'}", flush=True)
    copy_repository(ROOT, repo)
    python = scratch_venv(ROOT, work, repo)

    named = sorted({t for m in mutations for t in m.tests})
    if not args.skip_baseline:
        status, seconds, failing, tail = run_pytest(python, repo, named, args.timeout_s)
        print(f"baseline ({len(named)} files, unmutated): {status} in {seconds:.0f} s", flush=True)
        if status != "passed":
            print(tail, file=sys.stderr)
            raise SystemExit("the named tests fail without any mutation; fix them first")

    out = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    results = []
    if args.resume and out.is_file():  # a long run stopped midway keeps what it found
        wanted = {m.id for m in mutations}
        # a result without a verdict predates them: its "caught" may be another module's test failing, so it runs again
        results = [r for r in json.loads(out.read_text())["results"] if r["id"] in wanted and "verdict" in r]
        print(f"resuming: {len(results)} mutations already in {out}", flush=True)
    done = {r["id"] for r in results}
    for i, m in enumerate(mutations, 1):
        if m.id in done:
            continue
        result = run_mutation(python, repo, m, args)
        results.append(result)
        write_report(out, results, args.quick)
        shown = SURVIVED.upper() if result["verdict"] == SURVIVED else result["verdict"]
        print(
            f"[{i}/{len(mutations)}] {m.id}: {shown} ({result['status']} in {result['stage']}, {result['seconds']:.0f} s) {result['caught_by'] or ''}",
            flush=True,
        )
    print_table(results, out)
    return 0 if tally(results)["caught"] == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
