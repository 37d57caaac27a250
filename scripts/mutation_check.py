#!/usr/bin/env python3
"""Plant one-line bugs in the core modules, one at a time, and check that the test suite fails.

Each mutation is applied to a scratch copy of the repository (never to this checkout), the tests
most likely to catch it run first (``pytest -x``), and only if they all pass does the rest of the
suite run. A mutation is *caught* when the run fails (a failing test, an import error, or a run
past ``--timeout-s``), *survived* when every test passes: a gap to close with a sharper test.

The scratch copy imports its own code: a scratch venv whose site-packages reaches this checkout's
``.venv`` site-packages (the dependencies) through a .pth line, with the copy installed editable
into it (the package-dir mapping ldlm.export -> export/, ldlm.serve -> serve/ rules out PYTHONPATH).

    .venv/bin/python scripts/mutation_check.py                   # every mutation, JSON + table
    .venv/bin/python scripts/mutation_check.py --only batcher-pads-with-one --quick
    .venv/bin/python scripts/mutation_check.py --list

Not part of CI: it takes minutes (each pytest process pays the tiny model's fixtures again).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    id: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # the test files most likely to catch it, run first
    bug: str  # what a user would see


MUTATIONS: tuple[Mutation, ...] = (
    # --- the five from issue 16 ---------------------------------------------------------------
    Mutation(
        "scheduler-continuous-becomes-static",
        "serve/runtime/scheduler.py",
        'if not self._waiting or (self.policy == "static" and self._active):',
        "if not self._waiting or self._active:",
        ("tests/test_scheduler_values.py",),
        "continuous batching silently admits nothing until the batch drains",
    ),
    Mutation(
        "reconstruct-drops-mask",
        "ldlm/pipeline.py",
        "return self.decode(encoded.latents, encoded.attention_mask)",
        "return self.decode(encoded.latents)",
        ("tests/test_pipeline_values.py",),
        "padded rows of a batch decode their padding",
    ),
    Mutation(
        "batcher-pads-with-one",
        "serve/runtime/batcher.py",
        "array = np.pad(array, widths)",
        "array = np.pad(array, widths, constant_values=1)",
        ("tests/test_batcher_values.py",),
        "a short request batched with a long one attends its padding",
    ),
    Mutation(
        "bf16-rounding-garbled",
        "export/precision.py",
        ">> 16).astype(np.uint16)",
        ">> 15).astype(np.uint16)",
        ("tests/test_precision_values.py",),
        "every bf16 weight garbled",
    ),
    Mutation(
        "bench-speedup-inverted",
        "serve/checks/bench.py",
        'entry["eager"]["p50_ms"] / entry[name]["p50_ms"]',
        'entry[name]["p50_ms"] / entry["eager"]["p50_ms"]',
        ("tests/test_bench_values.py",),
        "a 4x faster backend reported as x0.25",
    ),
    # --- scheduler ------------------------------------------------------------------------------
    Mutation(
        "scheduler-step-mask-all-true",
        "serve/runtime/scheduler.py",
        "mask[i, :n] = True",
        "mask[i, :] = True",
        ("tests/test_scheduler.py", "tests/test_scheduler_values.py"),
        "samples in a padded bucket attend the padding",
    ),
    Mutation(
        "scheduler-decodes-wrong-latent",
        "serve/runtime/scheduler.py",
        'sample.x_mean if final == "mean" else sample.x0_hat',
        'sample.x0_hat if final == "mean" else sample.x_mean',
        ("tests/test_scheduler_values.py", "tests/test_scheduler.py"),
        "served generations differ from the pipeline's",
    ),
    Mutation(
        "scheduler-batch-overflows",
        "serve/runtime/scheduler.py",
        "len(self._active) < self.max_batch",
        "len(self._active) <= self.max_batch",
        ("tests/test_scheduler_values.py",),
        "denoiser batches one larger than max_batch (past the engine profile)",
    ),
    Mutation(
        "scheduler-drops-self-conditioning",
        "serve/runtime/scheduler.py",
        "pipe.graphs.denoise(x, t, stack([s.x0_prev for s in batch]), mask)",
        "pipe.graphs.denoise(x, t, torch.zeros_like(x), mask)",
        ("tests/test_scheduler.py", "tests/test_scheduler_values.py"),
        "self-conditioning input always zero",
    ),
    Mutation(
        "scheduler-keeps-cancelled",
        "serve/runtime/scheduler.py",
        "self._active = [s for s in self._active if not s.request.future.done()]",
        "self._active = list(self._active)",
        ("tests/test_scheduler_values.py", "tests/test_scheduler.py", "tests/test_cancellation.py"),
        "cancelled or failed requests keep their slots",
    ),
    # --- batcher --------------------------------------------------------------------------------
    Mutation(
        "batcher-takes-one-too-few",
        "serve/runtime/batcher.py",
        "size + self._queue[0].batch <= self.max_batch",
        "size + self._queue[0].batch < self.max_batch",
        ("tests/test_batcher_values.py",),
        "batches never reach max_batch",
    ),
    Mutation(
        "batcher-output-not-cut",
        "serve/runtime/batcher.py",
        "index[axis] = slice(0, length)",
        "index[axis] = slice(0, None)",
        ("tests/test_batcher_values.py",),
        "answers carry the batch's padding",
    ),
    Mutation(
        "batcher-rows-misrouted",
        "serve/runtime/batcher.py",
        "rows = slice(offset, offset + pending.batch)",
        "rows = slice(0, pending.batch)",
        ("tests/test_batcher_values.py",),
        "every request gets the first request's rows",
    ),
    # --- pipeline -------------------------------------------------------------------------------
    Mutation(
        "encode-mask-all-true",
        "ldlm/pipeline.py",
        "mask[i, : len(row)] = True",
        "mask[i, :] = True",
        ("tests/test_pipeline_values.py",),
        "short texts in a batch attend their padding",
    ),
    Mutation(
        "decode-texts-not-cut",
        "ldlm/pipeline.py",
        "self.tokenizer.decode(row[:n].tolist())",
        "self.tokenizer.decode(row.tolist())",
        ("tests/test_pipeline_values.py",),
        "texts include the decoded padding",
    ),
    Mutation(
        "token-ids-keep-padding",
        "ldlm/pipeline.py",
        "return [row[:n].tolist() for row, n in zip(self.token_ids, self.lengths)]",
        "return [row.tolist() for row, n in zip(self.token_ids, self.lengths)]",
        ("tests/test_reconstruct_ids.py",),
        "a batched text's ids include the padded positions",
    ),
    # --- sampler --------------------------------------------------------------------------------
    Mutation(
        "sde-drift-sign",
        "ldlm/sampler.py",
        "x_mean = x_t + h * beta * (x_t / 2 - eps_hat",
        "x_mean = x_t + h * beta * (x_t / 2 + eps_hat",
        ("tests/test_sampler.py",),
        "the reverse SDE pushes away from the data",
    ),
    Mutation(
        "ddim-alpha-at-t",
        "ldlm/sampler.py",
        "_bcast(schedule.alpha(t_next)) * x0_hat",
        "_bcast(schedule.alpha(t)) * x0_hat",
        ("tests/test_sampler.py", "tests/test_pipeline_values.py"),
        "DDIM steps to the wrong noise level",
    ),
    Mutation(
        "sample-seeds-shared",
        "ldlm/sampler.py",
        "int(s) >> 1 for s in states",
        "int(states[0]) >> 1 for s in states",
        ("tests/test_pipeline_values.py",),
        "every sample of a request is the same text",
    ),
    # --- precision ------------------------------------------------------------------------------
    Mutation(
        "head-lowered-to-fp16",
        "export/precision.py",
        'n.op_type == "ArgMax"]',
        'n.op_type == "ArgMin"]',
        ("tests/test_precision_values.py",),
        "the vocabulary head runs in FP16 (argmax flips)",
    ),
    Mutation(
        "fp16-weights-stored-as-bf16",
        "export/precision.py",
        "if low == TensorProto.FLOAT16:",
        "if low == TensorProto.BFLOAT16:",
        ("tests/test_precision_values.py",),
        "fp16 weights written in the bf16 layout",
    ),
    # --- verify / layernorm_network ---------------------------------------------------------------
    Mutation(
        "verify-axis-one-sided",
        "export/verify.py",
        "if axis != spec.axis:",
        "if axis > spec.axis:",
        ("tests/test_verify_values.py", "tests/test_verify.py"),
        "a LayerNorm over two axes passes verification",
    ),
    Mutation(
        "verify-count-one-sided",
        "export/verify.py",
        "if len(nodes) != len(expected):",
        "if len(nodes) < len(expected):",
        ("tests/test_verify_values.py",),
        "an extra LayerNormalization node passes verification",
    ),
    Mutation(
        "verify-compares-names-not-values",
        "export/verify.py",
        "if digest(value) == sha256:",
        "if input_name.endswith(('.weight', '.bias')) or digest(value) == sha256:",
        ("tests/test_verify_values.py",),
        "a weight with the right name and the wrong values passes",
    ),
    Mutation(
        "network-num-groups-ignored",
        "export/layernorm_network.py",
        'if getattr(layer, "num_groups", 1) != 1:',
        'if getattr(layer, "num_groups", 1) > 2:',
        ("tests/test_engine_network.py",),
        "a GroupNorm taken for a LayerNorm",
    ),
    Mutation(
        "network-count-one-sided",
        "export/layernorm_network.py",
        "if len(layers) != len(specs):",
        "if len(layers) < len(specs):",
        ("tests/test_engine_network.py",),
        "extra INormalizationLayers pass the check",
    ),
    Mutation(
        "network-axes-ignored",
        "export/layernorm_network.py",
        "if layer.axes != expected:",
        "if layer.axes & expected != expected:",
        ("tests/test_engine_network.py",),
        "a layer normalizing extra axes passes the check",
    ),
    Mutation(
        "strongly-typed-hard-coded",
        "export/trt_flavor.py",
        "return flag is not None and bool(network.get_flag(flag))",
        "return True",
        ("tests/test_engine_network.py",),
        "the manifest claims strong typing it did not read",
    ),
    # --- kserve ---------------------------------------------------------------------------------
    Mutation(
        "kserve-limit-off-by-one",
        "serve/api/kserve.py",
        "if len(out) > limit or decoder.unconsumed_tail:",
        "if len(out) > limit + 1 or decoder.unconsumed_tail:",
        ("tests/test_kserve_values.py",),
        "a compressed body one byte over the cap is accepted",
    ),
    Mutation(
        "kserve-binary-offset-ignored",
        "serve/api/kserve.py",
        "binary[offset : offset + size]",
        "binary[0:size]",
        ("tests/test_kserve_values.py",),
        "every binary input reads the first tensor's bytes",
    ),
    # --- parity / compare -----------------------------------------------------------------------
    Mutation(
        "parity-ignores-decoder-tokens",
        "serve/checks/parity.py",
        "and e2e and structure and decoder",
        "and e2e and structure",
        ("tests/test_parity_rules.py",),
        "a decoder whose argmax disagrees passes parity",
    ),
    Mutation(
        "parity-ignores-eps-probes",
        "serve/checks/parity.py",
        " and (self.eps_probes is None or self.eps_probes.passed)",
        "",
        ("tests/test_parity_rules.py", "tests/test_eps_probe.py"),
        "a LayerNorm whose eps is off passes parity",
    ),
    Mutation(
        "artifact-sha256-unchecked",
        "export/artifact.py",
        'if sha256_file(path) != record["sha256"]:',
        "if False:",
        ("tests/test_artifact_trust.py",),
        "edited weights of the same size are served",
    ),
    Mutation(
        "prompt-not-inpainted",
        "serve/runtime/scheduler.py",
        "if sample.request.prefix is not None:  # t stays a device tensor",
        "if False:  # t stays a device tensor",
        ("tests/test_openai_api.py",),
        "a completion ignores its prompt",
    ),
    Mutation(
        "parity-ignores-layer-norms",
        "serve/checks/parity.py",
        "ok = all(c.passed for c in self.graphs) and all(c.passed for c in self.layer_norms)",
        "ok = all(c.passed for c in self.graphs)",
        ("tests/test_parity_rules.py",),
        "a diverging LayerNorm output passes parity",
    ),
    Mutation(
        "compare-atol-or-rtol",
        "serve/checks/compare.py",
        "failing = (diff > atol) & (rel > rtol)",
        "failing = (diff > atol) | (rel > rtol)",
        ("tests/test_parity.py", "tests/test_parity_rules.py"),
        "elements within rtol fail on atol alone",
    ),
    # --- bench ----------------------------------------------------------------------------------
    Mutation(
        "bench-samples-per-s-ignores-batch",
        "serve/checks/bench.py",
        "round(1000 * batch / p50, 2)",
        "round(1000 / p50, 2)",
        ("tests/test_bench_values.py",),
        "throughput of batch 8 reported as batch 1's",
    ),
    Mutation(
        "bench-tokens-per-s-ignores-n",
        "serve/checks/bench.py",
        "round(n * length / p50, 2)",
        "round(length / p50, 2)",
        ("tests/test_bench_values.py",),
        "generation tokens/s n times too low",
    ),
    Mutation(
        "bench-throughput-ratio-inverted",
        "serve/checks/bench.py",
        'batching["continuous"]["tokens_per_s"] / batching["static"]["tokens_per_s"]',
        'batching["static"]["tokens_per_s"] / batching["continuous"]["tokens_per_s"]',
        ("tests/test_bench.py",),
        "continuous batching's gain reported upside down",
    ),
    # --- the TensorRT runtime (issue 17) ----------------------------------------------------------
    Mutation(
        "trt-no-lock",
        "serve/runtime/tensorrt_executor.py",
        "with self._lock:  # the context's shapes",
        "if True:  # the context's shapes",
        ("tests/test_tensorrt_runtime.py",),
        "two server threads rebind one context: a call reads another call's inputs",
    ),
    Mutation(
        "trt-no-chunks",
        "serve/runtime/tensorrt_executor.py",
        "        if len(chunks) == 1:\n",
        "        if True:\n",
        ("tests/test_tensorrt_runtime.py",),
        "n > 32 on /v1/generate fails the whole batch with 'outside every profile'",
    ),
    Mutation(
        "trt-shape-result-ignored",
        "serve/runtime/tensorrt_executor.py",
        "if not context.set_input_shape(name, shape):",
        "if context.set_input_shape(name, shape) is None:",
        ("tests/test_tensorrt_runtime.py",),
        "a shape TensorRT rejected runs anyway, on stale shapes",
    ),
    Mutation(
        "trt-address-result-ignored",
        "serve/runtime/tensorrt_executor.py",
        "if not context.set_tensor_address(name, tensor.data_ptr()):",
        "if context.set_tensor_address(name, tensor.data_ptr()) is None:",
        ("tests/test_tensorrt_runtime.py",),
        "a rejected address runs anyway, reading or writing stale memory",
    ),
    Mutation(
        "trt-one-context-for-all-profiles",
        "serve/runtime/tensorrt_executor.py",
        "        if profile not in self._contexts:\n",
        "        if not self._contexts:\n",
        ("tests/test_tensorrt_runtime.py",),
        "a batch of the second profile runs on the first profile's context",
    ),
    Mutation(
        "trt-stale-cache-counted-as-loaded",
        "serve/runtime/tensorrt_engine.py",
        "self.loaded = bool(cache.deserialize(self.path.read_bytes()))",
        "cache.deserialize(self.path.read_bytes()); self.loaded = True",
        ("tests/test_tensorrt_runtime.py",),
        "a runtime cache from another driver is reported as loaded",
    ),
    Mutation(
        "trt-logger-history-unbounded",
        "export/trt_flavor.py",
        "deque(maxlen=LOG_HISTORY)",
        "deque()",
        ("tests/test_engine_network.py",),
        "a long-running server's TensorRT message list grows without bound",
    ),
    Mutation(
        "trt-progress-arguments-swapped",
        "export/engine.py",
        "def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int)",
        "def phase_start(self, parent_phase: str | None, phase_name: str, num_steps: int)",
        ("tests/test_engine_network.py",),
        "build-engine shows no progress bar",
    ),
    Mutation(
        "trt-service-ignores-profile-batch",
        "serve/runtime/backends.py",
        "return capped, min([max_batch, *limits])",
        "return capped, max_batch",
        ("tests/test_tensorrt_runtime.py",),
        "the server batches more samples per execution than the engine's profiles hold",
    ),
    Mutation(
        "tokenizer-not-checked",
        "export/artifact.py",
        '    check_tokenizer(directory, manifest.get("tokenizer"))',
        "    pass",
        ("tests/test_artifact_trust.py",),
        "an edited tokenizer.json changes every answer of a server, unnoticed",
    ),
    Mutation(
        "triton-max-batch-beyond-profiles",
        "export/triton_repo.py",
        'max_batch = min(max_batch, max(p["batch"][2] for p in profiles))',
        "pass",
        ("tests/test_triton_repo.py",),
        "Triton refuses the plans: max_batch_size above the profiles' largest batch",
    ),
    # --- issue 25: the new solvers (verified caught by tests/test_solvers.py) -------------------------
    Mutation(
        "dpm3m-c2-sign",
        "ldlm/solvers.py",
        "c2 = (0.5 - (e - 1 + h) / h**2) / phi1",
        "c2 = (0.5 + (e - 1 + h) / h**2) / phi1",
        ("tests/test_solvers.py",),
        "dpm3m's third-order coefficient has the wrong sign: third order lost",
    ),
    Mutation(
        "dpm-r0-reversed",
        "ldlm/solvers.py",
        "r0 = (lam - lam1) / h",
        "r0 = (lam1 - lam) / h",
        ("tests/test_solvers.py",),
        "the multistep solvers extrapolate backwards",
    ),
    Mutation(
        "psc-fraction-zero",
        "ldlm/solvers.py",
        "PSC_FRACTION = 0.75",
        "PSC_FRACTION = 0.0",
        ("tests/test_solvers.py",),
        "dpm3m-psc silently becomes dpm3m",
    ),
    Mutation(
        "scheduler-past-lambda-of-first-row",
        "serve/runtime/scheduler.py",
        "push_past(sample.past, sample.x0_hat, lam[i], solver.history)",
        "push_past(sample.past, sample.x0_hat, lam[0], solver.history)",
        ("tests/test_solvers.py",),
        "in a continuous batch every sample's past carries the first sample's log-SNR",
    ),
    Mutation(
        "scheduler-psc-x0-prev-dropped",
        "serve/runtime/scheduler.py",
        "sample.x0_hat, sample.x0_prev = x0_g[i, :n], result.x0_prev[i, :n]",
        "sample.x0_hat, sample.x0_prev = x0_g[i, :n], x0_g[i, :n]",
        ("tests/test_solvers.py",),
        "served dpm3m-psc ignores the predicted self-conditioning",
    ),
    # --- issue 25: the model's modules against NumPy (tests/test_layers_values.py) ----------------------
    Mutation(
        "rmsnorm-eps-dropped",
        "ldlm/layers.py",
        "return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight",
        "return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True)) * self.weight",
        ("tests/test_layers_values.py",),
        "RMSNorm divides by zero on a zero row and ignores the config's eps",
    ),
    Mutation(
        "mlp-gelu-tanh",
        "ldlm/layers.py",
        "return self.fc_out(self.dropout(F.gelu(self.fc_in(self.norm(x)))))",
        'return self.fc_out(self.dropout(F.gelu(self.fc_in(self.norm(x)), approximate="tanh")))',
        ("tests/test_layers_values.py",),
        "the Perceivers' MLPs use GPT-2's approximate GELU, not the exact one",
    ),
    Mutation(
        "position-scale-inverted",
        "ldlm/layers.py",
        "self.scale = dim**-0.5",
        "self.scale = dim**0.5",
        ("tests/test_layers_values.py",),
        "position tables scaled by sqrt(D) instead of 1/sqrt(D)",
    ),
    Mutation(
        "per-stream-kv-ignored",
        "ldlm/layers.py",
        "kv_context = self.kv_context if self.kv_context is not None else self.kv",
        "kv_context = self.kv",
        ("tests/test_layers_values.py",),
        "the context's own key/value projection is loaded but never used",
    ),
    Mutation(
        "k-norm-skipped",
        "ldlm/layers.py",
        "k = self.k_norm(split_heads(k, self.n_heads))  # (B, H, S, hd)",
        "k = split_heads(k, self.n_heads)  # (B, H, S, hd)",
        ("tests/test_layers_values.py",),
        "Perceiver keys are not RMS-normed per head",
    ),
    Mutation(
        "causal-mask-upper",
        "ldlm/layers.py",
        ".tril()[None, None]",
        ".triu()[None, None]",
        ("tests/test_layers_values.py", "tests/test_gpt2.py"),
        "GPT-2 features attend the future instead of the past",
    ),
    Mutation(
        "query-stream-padding-unmasked",
        "ldlm/layers.py",
        "attention_bias(torch.cat([mask, mask], dim=1), dtype)",
        "attention_bias(torch.cat([mask, torch.ones_like(mask)], dim=1), dtype)",
        ("tests/test_layers_values.py",),
        "padded positions' latents leak into the real positions",
    ),
    Mutation(
        "time-embedding-cos-sin-swapped",
        "ldlm/layers.py",
        "return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)",
        "return torch.cat([torch.sin(args), torch.cos(args)], dim=-1)",
        ("tests/test_layers_values.py",),
        "the denoiser reads its time embedding in the wrong order (a trained checkpoint denoises at the wrong t)",
    ),
    Mutation(
        "context-normed-with-query-norm",
        "ldlm/layers.py",
        "xq, xc = self.norm_query(query), self.norm_context(context)",
        "xq, xc = self.norm_query(query), self.norm_query(context)",
        ("tests/test_layers_values.py",),
        "the context stream is normed with the query stream's gain",
    ),
    Mutation(
        "denoiser-norm-takes-layer-norm-eps",
        "ldlm/denoiser.py",
        "self.mlp_norm = RMSNorm(d, config.rms_norm_eps)",
        "self.mlp_norm = RMSNorm(d, config.layer_norm_eps)",
        ("tests/test_layers_values.py",),
        "the denoiser's MLP norms use the LayerNorm eps (equal in every preset, not in a trained config)",
    ),
    Mutation(
        "gpt2-gelu-exact",
        "ldlm/gpt2.py",
        'return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))',
        "return self.c_proj(F.gelu(self.c_fc(x)))",
        ("tests/test_layers_values.py", "tests/test_gpt2.py"),
        "features differ from Hugging Face's GPT-2 (gelu_new)",
    ),
    Mutation(
        "gpt2-ln2-reused",
        "ldlm/gpt2.py",
        "return x + self.mlp(self.ln_2(x))",
        "return x + self.mlp(self.ln_1(x))",
        ("tests/test_layers_values.py", "tests/test_gpt2.py"),
        "GPT-2's MLP reads the attention's LayerNorm",
    ),
    Mutation(
        "latent-bank-not-normed",
        "ldlm/latent_encoder.py",
        "latents = self.latent_norm(self.latent_bank[:length])[None]",
        "latents = self.latent_bank[:length][None]",
        ("tests/test_layers_values.py",),
        "the encoder's initial latents skip their RMSNorm",
    ),
    Mutation(
        "encoder-out-norm-skipped",
        "ldlm/latent_encoder.py",
        "return self.out_norm(latents)",
        "return latents",
        ("tests/test_layers_values.py",),
        "latents leave the encoder un-normed",
    ),
    Mutation(
        "query-scale-weight-dropped",
        "ldlm/latent_decoder.py",
        "scale = 1 + self.query_scale.weight[0, 0] + self.query_scale.bias[0]",
        "scale = 1 + self.query_scale.bias[0]",
        ("tests/test_layers_values.py",),
        "a trained query scale's weight is ignored",
    ),
    Mutation(
        "decoder-attn-scale-dropped",
        "ldlm/latent_decoder.py",
        "queries = queries + self.attn_scale * self.attn(queries, latents, attn_bias)",
        "queries = queries + self.attn(queries, latents, attn_bias)",
        ("tests/test_layers_values.py",),
        "the decoder blocks' learned attention scale is ignored",
    ),
    Mutation(
        "token-decoder-final-norm-skipped",
        "ldlm/token_decoder.py",
        "return self.head(self.norm(h))",
        "return self.head(h)",
        ("tests/test_layers_values.py",),
        "the vocabulary head reads un-normed features",
    ),
    Mutation(
        "token-decoder-causal",
        "ldlm/token_decoder.py",
        "bias = attention_bias(mask, h.dtype)  # bidirectional",
        "bias = attention_bias(mask, h.dtype, causal_len=h.shape[1])  # bidirectional",
        ("tests/test_layers_values.py",),
        "the token decoder only looks left",
    ),
    # --- config and checkpoint ------------------------------------------------------------------------
    Mutation(
        "config-int-range-top-refused",
        "ldlm/config.py",
        "type(value) is int and low <= value <= high",
        "type(value) is int and low <= value < high",
        ("tests/test_guards_config.py",),
        "the documented top of every integer range (256 denoiser layers, ...) refused",
    ),
    Mutation(
        "config-eps-zero-allowed",
        "ldlm/config.py",
        "math.isfinite(value) and above < value <= at_most",
        "math.isfinite(value) and above <= value <= at_most",
        ("tests/test_guards_config.py",),
        "a config with eps 0 loads: a zero row normalizes to NaN",
    ),
    Mutation(
        "config-eos-off-by-one",
        "ldlm/config.py",
        "require(0 <= c.eos_token_id < c.vocab_size,",
        "require(0 <= c.eos_token_id <= c.vocab_size,",
        ("tests/test_guards_config.py",),
        "an end-of-text id past the vocabulary loads",
    ),
    Mutation(
        "config-dropout-one-allowed",
        "ldlm/config.py",
        "require(0.0 <= c.dropout < 1.0,",
        "require(0.0 <= c.dropout <= 1.0,",
        ("tests/test_guards_config.py",),
        "dropout 1 (every activation zeroed in training) loads",
    ),
    Mutation(
        "feature-blocks-off-by-one",
        "ldlm/config.py",
        "return self.gpt2_layers + 1 + self.feature_layer",
        "return self.gpt2_layers + self.feature_layer",
        ("tests/test_guards_config.py", "tests/test_gpt2.py"),
        "features read one GPT-2 block too early",
    ),
    Mutation(
        "checkpoint-unexpected-not-named",
        "ldlm/checkpoint.py",
        "unexpected = sorted(set(found) - set(expected))",
        "unexpected = []",
        ("tests/test_checkpoint.py",),
        "a checkpoint with extra tensors fails with torch's error, not ours",
    ),
    Mutation(
        "mask-embedding-off-by-one",
        "ldlm/checkpoint.py",
        "if config.mask_token_id < wte.shape[0] else",
        "if config.mask_token_id <= wte.shape[0] else",
        ("tests/test_gpt2.py",),
        "ldlm init --gpt2-dir fails with an IndexError for the mask token",
    ),
    Mutation(
        "random-std-negative",
        "ldlm/checkpoint.py",
        "std.copy_(torch.exp(normal(std, 0.2)))",
        "std.copy_(normal(std, 0.2))",
        ("tests/test_eps_probe.py",),
        "norm_init=random draws negative standard deviations",
    ),
    Mutation(
        "checkpoint-overwrite-inverted",
        "ldlm/files.py",
        "if Path(out).exists() and not overwrite:",
        "if Path(out).exists() and overwrite:",
        ("tests/test_checkpoint.py",),
        "an existing checkpoint is replaced without --force",
    ),
    # --- OpenAI completions (lines identical on the http branch) ------------------------------------
    Mutation(
        "completion-eos-kept",
        "serve/api/routes/openai.py",
        "ids = ids[: ids.index(eos)] if stop else ids",
        "ids = ids[: ids.index(eos) + 1] if stop else ids",
        ("tests/test_guards_http.py",),
        "usage counts the end-of-text token as a completion token",
    ),
    Mutation(
        "completion-never-stops",
        "serve/api/routes/openai.py",
        '"finish_reason": "stop" if stop else "length"',
        '"finish_reason": "length"',
        ("tests/test_guards_http.py",),
        'finish_reason is never "stop"',
    ),
    Mutation(
        "completion-choices-unbounded",
        "serve/api/routes/openai.py",
        "if len(prompts) * body.n > settings.max_n:",
        "if body.n > settings.max_n:",
        ("tests/test_guards_http.py",),
        "4 prompts x n=64 runs 256 samples on a server capped at 64",
    ),
    Mutation(
        "completion-budget-off-by-one",
        "serve/api/routes/openai.py",
        "if len(row) + body.max_tokens > config.max_seq_len:",
        "if len(row) + body.max_tokens >= config.max_seq_len:",
        ("tests/test_guards_http.py",),
        "a prompt that exactly fills max_seq_len with max_tokens is refused",
    ),
    Mutation(
        "completion-prompts-share-a-seed",
        "serve/api/routes/openai.py",
        "(seed + i) % 2**63",
        "seed % 2**63",
        ("tests/test_guards_http.py",),
        "two identical prompts of one request get identical completions",
    ),
    Mutation(
        "completion-index-restarts",
        "serve/api/routes/openai.py",
        '"index": first_index + j',
        '"index": j',
        ("tests/test_guards_http.py",),
        "choices of the second prompt reuse the first prompt's indices",
    ),
    # --- streaming and the outer guard ---------------------------------------------------------------
    Mutation(
        "sse-single-newline",
        "serve/api/streaming.py",
        'f"data: {payload}\\n\\n".encode()',
        'f"data: {payload}\\n".encode()',
        ("tests/test_guards_middleware.py",),
        "events never end: clients see one endless event",
    ),
    Mutation(
        "preview-budget-one-refused",
        "serve/api/streaming.py",
        "if not 0 < budget <= 1:",
        "if not 0 < budget < 1:",
        ("tests/test_guards_middleware.py",),
        "--preview-budget 1 (unthrottled previews) refused",
    ),
    Mutation(
        "preview-forget-drops-other-streams",
        "serve/api/streaming.py",
        "for key in [k for k in self._pending if k[0] is stream]:",
        "for key in [k for k in self._pending if k[0] is not stream]:",
        ("tests/test_guards_middleware.py",),
        "a client leaving drops everyone else's pending previews",
    ),
    Mutation(
        "body-cap-off-by-one",
        "serve/api/http_guard.py",
        "if received > limit:  # chunked",
        "if received >= limit:  # chunked",
        ("tests/test_guards_middleware.py",),
        "a chunked body of exactly --max-body-mb is refused",
    ),
    Mutation(
        "content-length-cap-off-by-one",
        "serve/api/http_guard.py",
        "int(content_length) > limit):",
        "int(content_length) >= limit):",
        ("tests/test_guards_middleware.py",),
        "a body of exactly --max-body-mb is refused",
    ),
    Mutation(
        "health-prefix-too-wide",
        "serve/api/http_guard.py",
        'OPEN_PREFIXES = ("/v2/health/", "/static/swagger/")',
        'OPEN_PREFIXES = ("/v2/health", "/static/swagger/")',
        ("tests/test_guards_middleware.py",),
        "paths that merely start with /v2/health skip the bearer check",
    ),
    Mutation(
        "queue-full-without-retry-after",
        "serve/api/http_guard.py",
        '503, str(error), {"Retry-After": "1"}, scope["path"])',
        '503, str(error), {}, scope["path"])',
        ("tests/test_guards_middleware.py",),
        "clients get no Retry-After on a full queue",
    ),
    # --- KServe parsing ------------------------------------------------------------------------------
    Mutation(
        "kserve-binary-nan-unchecked",
        "serve/api/kserve.py",
        'if dtype.kind == "f" and not np.isfinite(array).all():',
        'if dtype.kind == "f" and size is None and not np.isfinite(array).all():',
        ("tests/test_guards_kserve.py", "tests/test_guards_http.py"),
        "NaN and Infinity in binary tensors reach the graphs",
    ),
    Mutation(
        "kserve-json-inf-unchecked",
        "serve/api/kserve.py",
        "if not np.isfinite(wide).all():",
        "if np.isnan(wide).any():",
        ("tests/test_guards_kserve.py", "tests/test_guards_http.py"),
        "JSON Infinity is refused as an over-large number, not as Infinity",
    ),
    Mutation(
        "kserve-json-nonfinite-refusal-removed",
        "serve/api/kserve.py",
        "if not np.isfinite(wide).all():",
        "if False:",
        ("tests/test_guards_kserve.py", "tests/test_guards_http.py"),
        "issue 25's survivor: JSON Infinity gets another message, NaN only a later check",
    ),
    Mutation(
        "kserve-int-max-off-by-one",
        "serve/api/kserve.py",
        "or max(flat) > info.max):",
        "or max(flat) >= info.max):",
        ("tests/test_guards_kserve.py",),
        "INT32 2**31-1 refused",
    ),
    Mutation(
        "kserve-bool-as-int",
        "serve/api/kserve.py",
        'JSON_TYPES: dict[str, set[type]] = {"b": {bool}, "i": {int}, "f": {int, float}}',
        'JSON_TYPES: dict[str, set[type]] = {"b": {bool}, "i": {int, bool}, "f": {int, float}}',
        ("tests/test_guards_kserve.py",),
        "true/false accepted as token ids",
    ),
    Mutation(
        "kserve-header-length-equal-refused",
        "serve/api/kserve.py",
        "if not 0 < json_size <= len(body):",
        "if not 0 < json_size < len(body):",
        ("tests/test_guards_kserve.py",),
        "a JSON-only body that sends its Inference-Header-Content-Length is refused",
    ),
    Mutation(
        "kserve-rank-limit-off-by-one",
        "serve/api/kserve.py",
        "or len(shape) > 8:",
        "or len(shape) >= 8:",
        ("tests/test_guards_kserve.py",),
        "rank-8 tensors refused",
    ),
    Mutation(
        "kserve-duplicate-input-overwrites",
        "serve/api/kserve.py",
        "if name in inputs:",
        "if name in raw_inputs:",
        ("tests/test_guards_kserve.py",),
        "an input given twice silently keeps the second",
    ),
    # --- the eps probe's math ------------------------------------------------------------------------
    Mutation(
        "eps-budget-halved",
        "serve/checks/layernorm_cases.py",
        "return 2 * math.ceil(math.log2(max(n, 2))) + 8",
        "return math.ceil(math.log2(max(n, 2))) + 8",
        ("tests/test_eps_probe_math.py",),
        "the float32 bound is too tight: correct backends fail the probes",
    ),
    Mutation(
        "implied-eps-without-variance",
        "serve/checks/eps_probe.py",
        "float(np.median(s**2 - (centered**2).mean(axis=1)))",
        "float(np.median(s**2))",
        ("tests/test_eps_probe_math.py", "tests/test_eps_probe.py"),
        "the implied eps includes the rows' variance",
    ),
    Mutation(
        "probe-rows-not-centered",
        "serve/checks/eps_probe.py",
        "return (r - r.mean()) / r.std()",
        "return r / r.std()",
        ("tests/test_eps_probe_math.py",),
        "sweep rows are not zero-mean: the implied eps is off",
    ),
    Mutation(
        "eps-bound-without-mean-term",
        "serve/checks/eps_probe.py",
        "(np.abs(z_ref) + mean_magnitude / sigma)",
        "np.abs(z_ref)",
        ("tests/test_eps_probe_math.py",),
        "every correct float32 LayerNorm fails the large-mean rows",
    ),
    Mutation(
        "eps-bound-mean-not-magnitude",
        "serve/checks/eps_probe.py",
        "mean_magnitude = np.abs(x64).mean(axis=1, keepdims=True)",
        "mean_magnitude = np.abs(mean)",
        ("tests/test_eps_probe_math.py",),
        "a correct float32 LayerNorm (torch's) fails where z ~ 0 in rows of mean ~0",
    ),
    Mutation(
        "kserve-unknown-field-ignored",
        "serve/api/kserve.py",
        '    refuse_unknown_fields(payload, REQUEST_FIELDS, "the request")\n',
        "",
        ("tests/test_guards_kserve.py",),
        "a misspelled 'outputs' is ignored and the request runs without it",
    ),
    Mutation(
        "stop-cut-re-encoded",
        "serve/api/routes/openai.py",
        "used += self.pipeline.tokenizer.count_tokens(text) if cut >= 0 else len(ids)",
        "used += len(self.pipeline.tokenizer.encode([text])[0]) if cut >= 0 and text else len(ids)",
        ("tests/test_strict_input.py",),
        "a stop text leaving a blank completion answers 400",
    ),
    Mutation(
        "text-too-long-named-as-ids",
        "ldlm/pipeline.py",
        "if len(row) > self.config.max_seq_len:",
        "if False:",
        ("tests/test_pipeline.py",),
        "a text too long is named len(ids[i]), not texts[i] with its token count",
    ),
    # --- deployment entry points ---------------------------------------------------------------------
    Mutation(
        "triton-n-max-refused",
        "serve/deploy/triton_generate.py",
        "if not 1 <= n <= self.max_n:",
        "if not 1 <= n < self.max_n:",
        ("tests/test_guards_deploy.py",),
        "ldlm_generate refuses N = max_n",
    ),
    Mutation(
        "triton-bls-chunks-ignored",
        "serve/deploy/triton_generate.py",
        "chunk = self.bls_max_batch or n",
        "chunk = n",
        ("tests/test_guards_deploy.py",),
        "N above the graphs' max_batch_size fails every BLS call",
    ),
    Mutation(
        "triton-t-not-reshaped",
        "serve/deploy/triton_generate.py",
        '"t": t.float().numpy().reshape(-1, 1)',
        '"t": t.float().numpy()',
        ("tests/test_triton_repo.py",),
        "Triton refuses t: config.pbtxt declares dims [1]",
    ),
    Mutation(
        "ray-initial-replicas-from-min",
        "serve/deploy/ray_app.py",
        '"initial_replicas": self.replicas,',
        '"initial_replicas": self.min_replicas,',
        ("tests/test_guards_deploy.py",),
        "an autoscaled deployment starts at min_replicas, not --replicas",
    ),
    Mutation(
        "ray-zero-is-true",
        "serve/deploy/ray_app.py",
        'BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False}',
        'BOOL_WORDS = {"true": True, "false": False, "1": True, "0": True}',
        ("tests/test_guards_deploy.py",),
        "serve run ... trt_cuda_graphs=0 turns CUDA graphs on",
    ),
    Mutation(
        "ray-zero-replicas",
        "serve/deploy/ray_app.py",
        '"replicas": (self.replicas, 1, 4096)',
        '"replicas": (self.replicas, 0, 4096)',
        ("tests/test_guards_deploy.py",),
        "a deployment of zero replicas is accepted and never answers",
    ),
    # --- Ctrl-C that Python drops (ldlm.interrupts; CI saw `ldlm serve` start after one) ----------
    Mutation(
        "interrupt-not-remembered",
        "ldlm/interrupts.py",
        "    _received.set()  # first, so that a dropped KeyboardInterrupt is still known",
        "    pass",
        ("tests/test_interrupts.py",),
        "a Ctrl-C dropped inside a weakref callback is forgotten: the export goes on and the server starts",
    ),
    Mutation(
        "dropped-interrupt-printed",
        "ldlm/interrupts.py",
        "        if not (isinstance(unraisable.exc_value, KeyboardInterrupt) and interrupted()):",
        "        if True:",
        ("tests/test_interrupts.py",),
        "Ctrl-C prints an 'Exception ignored' traceback before 'interrupted'",
    ),
    Mutation(
        "serve-starts-after-dropped-interrupt",
        "serve/api/server.py",
        "        raise_if_interrupted()  # Ctrl-C while preparing, dropped by Python where it landed: do not start serving",
        "        pass",
        ("tests/test_interrupts.py",),
        "Ctrl-C while `ldlm serve` exports is lost and the server starts anyway",
    ),
    Mutation(
        "engine-monitor-ignores-interrupt",
        "export/engine.py",
        "            return not interrupted()",
        "            return True",
        ("tests/test_interrupts.py",),
        "Ctrl-C during an engine build goes on building the whole graph",
    ),
    Mutation(
        "build-interrupts-not-deferred",
        "export/engine.py",
        "    with logger.capture() as messages, deferred_interrupts():",
        "    with logger.capture() as messages:",
        ("tests/test_interrupts.py",),
        "Ctrl-C during a build prints TensorRT's '[ERROR] Exception caught in log()' trace",
    ),
    Mutation(
        "engine-monitor-only-with-progress",
        "export/engine.py",
        'BuildProgress(trt, onnx_path.stem, progress) if hasattr(trt, "IProgressMonitor") else None',
        'BuildProgress(trt, onnx_path.stem, progress) if progress and hasattr(trt, "IProgressMonitor") else None',
        ("tests/test_interrupts.py",),
        "without a progress bar, Ctrl-C during an engine build waits for the whole build",
    ),
    Mutation(
        "interrupt-delivered-forever",
        "ldlm/interrupts.py",
        """        _received.clear()
        raise KeyboardInterrupt""",
        "        raise KeyboardInterrupt",
        ("tests/test_interrupts.py",),
        "after one Ctrl-C in a notebook, every later engine build stops at once",
    ),
    Mutation(
        "engine-interrupt-reported-as-failure",
        "export/engine.py",
        "    raise_if_interrupted()  # a Ctrl-C recorded during the build",
        "    pass  # a Ctrl-C recorded during the build",
        ("tests/test_interrupts.py",),
        "Ctrl-C during an engine build is reported as 'TensorRT could not build ... BuildCanceled'",
    ),
)


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
    probe = "import ldlm, ldlm.serve.runtime.scheduler as s, ldlm.export.verify as v; print(ldlm.__file__); print(s.__file__); print(v.__file__)"
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
    failing = [line.split(" ", 2)[1] for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    status = {0: "passed", 1: "failed"}.get(done.returncode, "error")
    return status, seconds, failing, output[-2000:]


def check_mutations(root: Path, mutations: tuple[Mutation, ...]) -> None:
    problems = []
    for m in mutations:
        text = (root / m.path).read_text()
        if text.count(m.old) != 1:
            problems.append(f"{m.id}: {m.old!r} occurs {text.count(m.old)} times in {m.path}; it must occur once")
        for test in m.tests:
            if not (root / test).is_file():
                problems.append(f"{m.id}: test file {test} does not exist")
    if len({m.id for m in mutations}) != len(mutations):
        problems.append("mutation ids are not unique")
    if problems:
        raise SystemExit("mutation list is stale:\n  " + "\n  ".join(problems))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated mutation ids (default: all)")
    parser.add_argument("--quick", action="store_true", help="run only each mutation's named test files, not the rest of the suite")
    parser.add_argument("--skip-baseline", action="store_true", help="do not first check that the named tests pass unmutated")
    parser.add_argument("--work", default="/tmp/ldlm-mutation-check", help="scratch directory (default: /tmp/ldlm-mutation-check)")
    parser.add_argument("--out", default="runs/mutation_check.json", help="JSON report (default: runs/mutation_check.json)")
    parser.add_argument("--timeout-s", type=float, default=1800, help="per pytest run; a run past it counts as caught (default: 1800)")
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    args = parser.parse_args(argv)

    mutations = MUTATIONS
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - {m.id for m in MUTATIONS})
        if unknown:
            parser.error(f"--only {','.join(unknown)}: unknown; allowed: {', '.join(m.id for m in MUTATIONS)}")
        mutations = tuple(m for m in MUTATIONS if m.id in wanted)
    if args.list:
        for m in mutations:
            print(f"{m.id:38s} {m.path:28s} {m.bug}")
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

    results = []
    for i, m in enumerate(mutations, 1):
        target = repo / m.path
        original = target.read_text()
        target.write_text(original.replace(m.old, m.new, 1))
        try:
            status, seconds, failing, tail = run_pytest(python, repo, list(m.tests), args.timeout_s)
            stage = "named tests"
            if status == "passed" and not args.quick:
                rest = ["tests", *(f"--ignore={t}" for t in m.tests)]
                status, more, failing, tail = run_pytest(python, repo, rest, args.timeout_s)
                seconds += more
                stage = "rest of the suite"
        finally:
            target.write_text(original)
        caught = status != "passed"
        results.append(
            {
                **asdict(m),
                "caught": caught,
                "status": status,
                "stage": stage,
                "seconds": round(seconds, 1),
                "failing_tests": failing[:5],
                "output_tail": "" if caught and failing else tail[-600:],
            }
        )
        verdict = "caught" if caught else "SURVIVED"
        print(f"[{i}/{len(mutations)}] {m.id}: {verdict} ({status} in {stage}, {seconds:.0f} s) {failing[:1]}", flush=True)

    caught = sum(r["caught"] for r in results)
    report = {"mutations": len(results), "caught": caught, "survived": len(results) - caught, "quick": args.quick, "results": results}
    out = ROOT / args.out if not Path(args.out).is_absolute() else Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out)

    print(f"\n{'mutation':38s} {'file':28s} {'result':9s} {'s':>6s}  caught by")
    for r in results:
        by = r["failing_tests"][0] if r["failing_tests"] else r["status"]
        print(f"{r['id']:38s} {r['path']:28s} {'caught' if r['caught'] else 'SURVIVED':9s} {r['seconds']:6.0f}  {by}")
    print(f"\n{caught}/{len(results)} caught; report: {out}")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
