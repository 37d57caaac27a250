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
    Mutation("scheduler-continuous-becomes-static", "serve/runtime/scheduler.py",
             'if self.policy == "static" and self._active:', "if self._active:",
             ("tests/test_scheduler_values.py",), "continuous batching silently admits nothing until the batch drains"),
    Mutation("reconstruct-drops-mask", "ldlm/pipeline.py",
             "return self.decode(encoded.latents, encoded.attention_mask)", "return self.decode(encoded.latents)",
             ("tests/test_pipeline_values.py",), "padded rows of a batch decode their padding"),
    Mutation("batcher-pads-with-one", "serve/runtime/batcher.py",
             "array = np.pad(array, widths)", "array = np.pad(array, widths, constant_values=1)",
             ("tests/test_batcher_values.py",), "a short request batched with a long one attends its padding"),
    Mutation("bf16-rounding-garbled", "export/precision.py",
             ">> 16).astype(np.uint16)", ">> 15).astype(np.uint16)",
             ("tests/test_precision_values.py",), "every bf16 weight garbled"),
    Mutation("bench-speedup-inverted", "serve/checks/bench.py",
             'entry["eager"]["p50_ms"] / entry[name]["p50_ms"]', 'entry[name]["p50_ms"] / entry["eager"]["p50_ms"]',
             ("tests/test_bench_values.py",), "a 4x faster backend reported as x0.25"),
    # --- scheduler ------------------------------------------------------------------------------
    Mutation("scheduler-step-mask-all-true", "serve/runtime/scheduler.py",
             "mask[i, :n] = True", "mask[i, :] = True",
             ("tests/test_scheduler.py", "tests/test_scheduler_values.py"), "samples in a padded bucket attend the padding"),
    Mutation("scheduler-decodes-wrong-latent", "serve/runtime/scheduler.py",
             'sample.x_mean if final == "mean" else sample.x0_hat', 'sample.x0_hat if final == "mean" else sample.x_mean',
             ("tests/test_scheduler_values.py", "tests/test_scheduler.py"), "served generations differ from the pipeline's"),
    Mutation("scheduler-batch-overflows", "serve/runtime/scheduler.py",
             "len(self._active) < self.max_batch", "len(self._active) <= self.max_batch",
             ("tests/test_scheduler_values.py",), "denoiser batches one larger than max_batch (past the engine profile)"),
    Mutation("scheduler-drops-self-conditioning", "serve/runtime/scheduler.py",
             "sample.x0_hat = x0_hat[i, :n]", "sample.x0_hat = torch.zeros_like(sample.x)",
             ("tests/test_scheduler.py", "tests/test_scheduler_values.py"), "self-conditioning input always zero"),
    Mutation("scheduler-keeps-cancelled", "serve/runtime/scheduler.py",
             "self._active = [s for s in self._active if not s.request.future.done()]", "self._active = list(self._active)",
             ("tests/test_scheduler_values.py", "tests/test_scheduler.py"), "cancelled or failed requests keep their slots"),
    # --- batcher --------------------------------------------------------------------------------
    Mutation("batcher-takes-one-too-few", "serve/runtime/batcher.py",
             "size + self._queue[0].batch <= self.max_batch", "size + self._queue[0].batch < self.max_batch",
             ("tests/test_batcher_values.py",), "batches never reach max_batch"),
    Mutation("batcher-output-not-cut", "serve/runtime/batcher.py",
             "index[axis] = slice(0, length)", "index[axis] = slice(0, None)",
             ("tests/test_batcher_values.py",), "answers carry the batch's padding"),
    Mutation("batcher-rows-misrouted", "serve/runtime/batcher.py",
             "rows = slice(offset, offset + pending.batch)", "rows = slice(0, pending.batch)",
             ("tests/test_batcher_values.py",), "every request gets the first request's rows"),
    # --- pipeline -------------------------------------------------------------------------------
    Mutation("encode-mask-all-true", "ldlm/pipeline.py",
             "mask[i, : len(row)] = True", "mask[i, :] = True",
             ("tests/test_pipeline_values.py",), "short texts in a batch attend their padding"),
    Mutation("decode-texts-not-cut", "ldlm/pipeline.py",
             "self.tokenizer.decode(row[:n].tolist())", "self.tokenizer.decode(row.tolist())",
             ("tests/test_pipeline_values.py",), "texts include the decoded padding"),
    Mutation("token-ids-keep-padding", "ldlm/pipeline.py",
             "return [row[:n].tolist() for row, n in zip(self.token_ids, self.lengths)]",
             "return [row.tolist() for row, n in zip(self.token_ids, self.lengths)]",
             ("tests/test_reconstruct_ids.py",), "a batched text's ids include the padded positions"),
    # --- sampler --------------------------------------------------------------------------------
    Mutation("sde-drift-sign", "ldlm/sampler.py",
             "x_mean = x_t + h * beta * (x_t / 2 - eps_hat", "x_mean = x_t + h * beta * (x_t / 2 + eps_hat",
             ("tests/test_sampler.py",), "the reverse SDE pushes away from the data"),
    Mutation("ddim-alpha-at-t", "ldlm/sampler.py",
             "_bcast(schedule.alpha(t_next)) * x0_hat", "_bcast(schedule.alpha(t)) * x0_hat",
             ("tests/test_sampler.py", "tests/test_pipeline_values.py"), "DDIM steps to the wrong noise level"),
    Mutation("sample-seeds-shared", "ldlm/sampler.py",
             "int(s) >> 1 for s in states", "int(states[0]) >> 1 for s in states",
             ("tests/test_pipeline_values.py",), "every sample of a request is the same text"),
    # --- precision ------------------------------------------------------------------------------
    Mutation("head-lowered-to-fp16", "export/precision.py",
             'n.op_type == "ArgMax"]', 'n.op_type == "ArgMin"]',
             ("tests/test_precision_values.py",), "the vocabulary head runs in FP16 (argmax flips)"),
    Mutation("fp16-weights-stored-as-bf16", "export/precision.py",
             "if low == TensorProto.FLOAT16:", "if low == TensorProto.BFLOAT16:",
             ("tests/test_precision_values.py",), "fp16 weights written in the bf16 layout"),
    # --- verify / layernorm_network ---------------------------------------------------------------
    Mutation("verify-axis-one-sided", "export/verify.py",
             "if axis != spec.axis:", "if axis > spec.axis:",
             ("tests/test_verify_values.py", "tests/test_verify.py"), "a LayerNorm over two axes passes verification"),
    Mutation("verify-count-one-sided", "export/verify.py",
             "if len(nodes) != len(expected):", "if len(nodes) < len(expected):",
             ("tests/test_verify_values.py",), "an extra LayerNormalization node passes verification"),
    Mutation("verify-compares-names-not-values", "export/verify.py",
             "if digest(value) == sha256:", "if input_name.endswith(('.weight', '.bias')) or digest(value) == sha256:",
             ("tests/test_verify_values.py",), "a weight with the right name and the wrong values passes"),
    Mutation("network-num-groups-ignored", "export/layernorm_network.py",
             'if getattr(layer, "num_groups", 1) != 1:', 'if getattr(layer, "num_groups", 1) > 2:',
             ("tests/test_engine_network.py",), "a GroupNorm taken for a LayerNorm"),
    Mutation("network-count-one-sided", "export/layernorm_network.py",
             "if len(layers) != len(specs):", "if len(layers) < len(specs):",
             ("tests/test_engine_network.py",), "extra INormalizationLayers pass the check"),
    Mutation("network-axes-ignored", "export/layernorm_network.py",
             "if layer.axes != expected:", "if layer.axes & expected != expected:",
             ("tests/test_engine_network.py",), "a layer normalizing extra axes passes the check"),
    Mutation("strongly-typed-hard-coded", "export/engine.py",
             "return flag is not None and bool(network.get_flag(flag))", "return True",
             ("tests/test_engine_network.py",), "the manifest claims strong typing it did not read"),
    # --- kserve ---------------------------------------------------------------------------------
    Mutation("kserve-limit-off-by-one", "serve/api/kserve.py",
             "if len(out) > limit or decoder.unconsumed_tail:", "if len(out) > limit + 1 or decoder.unconsumed_tail:",
             ("tests/test_kserve_values.py",), "a compressed body one byte over the cap is accepted"),
    Mutation("kserve-binary-offset-ignored", "serve/api/kserve.py",
             "binary[offset : offset + size]", "binary[0:size]",
             ("tests/test_kserve_values.py",), "every binary input reads the first tensor's bytes"),
    # --- parity / compare -----------------------------------------------------------------------
    Mutation("parity-ignores-decoder-tokens", "serve/checks/parity.py",
             "and e2e and structure and decoder", "and e2e and structure",
             ("tests/test_parity_rules.py",), "a decoder whose argmax disagrees passes parity"),
    Mutation("parity-ignores-eps-probes", "serve/checks/parity.py",
             " and (self.eps_probes is None or self.eps_probes.passed)", "",
             ("tests/test_parity_rules.py", "tests/test_eps_probe.py"), "a LayerNorm whose eps is off passes parity"),
    Mutation("artifact-sha256-unchecked", "export/artifact.py",
             'if sha256_file(path) != record["sha256"]:', "if False:",
             ("tests/test_artifact_trust.py",), "edited weights of the same size are served"),
    Mutation("prompt-not-inpainted", "serve/runtime/scheduler.py",
             "if sample.request.prefix is not None:  # t stays a device tensor", "if False:  # t stays a device tensor",
             ("tests/test_openai_api.py",), "a completion ignores its prompt"),
    Mutation("parity-ignores-layer-norms", "serve/checks/parity.py",
             "ok = all(c.passed for c in self.graphs) and all(c.passed for c in self.layer_norms)",
             "ok = all(c.passed for c in self.graphs)",
             ("tests/test_parity_rules.py",), "a diverging LayerNorm output passes parity"),
    Mutation("compare-atol-or-rtol", "serve/checks/compare.py",
             "failing = (diff > atol) & (rel > rtol)", "failing = (diff > atol) | (rel > rtol)",
             ("tests/test_parity.py", "tests/test_parity_rules.py"), "elements within rtol fail on atol alone"),
    # --- bench ----------------------------------------------------------------------------------
    Mutation("bench-samples-per-s-ignores-batch", "serve/checks/bench.py",
             "round(1000 * batch / p50, 2)", "round(1000 / p50, 2)",
             ("tests/test_bench_values.py",), "throughput of batch 8 reported as batch 1's"),
    Mutation("bench-tokens-per-s-ignores-n", "serve/checks/bench.py",
             "round(n * length / p50, 2)", "round(length / p50, 2)",
             ("tests/test_bench_values.py",), "generation tokens/s n times too low"),
    Mutation("bench-throughput-ratio-inverted", "serve/checks/bench.py",
             'batching["continuous"]["tokens_per_s"] / batching["static"]["tokens_per_s"]',
             'batching["static"]["tokens_per_s"] / batching["continuous"]["tokens_per_s"]',
             ("tests/test_bench.py",), "continuous batching's gain reported upside down"),
    # --- the TensorRT runtime (issue 17) ----------------------------------------------------------
    Mutation("trt-no-lock", "serve/runtime/tensorrt_executor.py",
             "with self._lock:  # the context's shapes", "if True:  # the context's shapes",
             ("tests/test_tensorrt_runtime.py",), "two server threads rebind one context: a call reads another call's inputs"),
    Mutation("trt-no-chunks", "serve/runtime/tensorrt_executor.py",
             "        if len(chunks) == 1:\n", "        if True:\n",
             ("tests/test_tensorrt_runtime.py",), "n > 32 on /v1/generate fails the whole batch with 'outside every profile'"),
    Mutation("trt-shape-result-ignored", "serve/runtime/tensorrt_executor.py",
             "if not context.set_input_shape(name, shape):", "if context.set_input_shape(name, shape) is None:",
             ("tests/test_tensorrt_runtime.py",), "a shape TensorRT rejected runs anyway, on stale shapes"),
    Mutation("trt-address-result-ignored", "serve/runtime/tensorrt_executor.py",
             "if not context.set_tensor_address(name, tensor.data_ptr()):", "if context.set_tensor_address(name, tensor.data_ptr()) is None:",
             ("tests/test_tensorrt_runtime.py",), "a rejected address runs anyway, reading or writing stale memory"),
    Mutation("trt-one-context-for-all-profiles", "serve/runtime/tensorrt_executor.py",
             "        if profile not in self._contexts:\n", "        if not self._contexts:\n",
             ("tests/test_tensorrt_runtime.py",), "a batch of the second profile runs on the first profile's context"),
    Mutation("trt-stale-cache-counted-as-loaded", "serve/runtime/tensorrt_engine.py",
             "self.loaded = bool(cache.deserialize(self.path.read_bytes()))", "cache.deserialize(self.path.read_bytes()); self.loaded = True",
             ("tests/test_tensorrt_runtime.py",), "a runtime cache from another driver is reported as loaded"),
    Mutation("trt-logger-history-unbounded", "export/trt_flavor.py",
             "deque(maxlen=LOG_HISTORY)", "deque()",
             ("tests/test_engine_network.py",), "a long-running server's TensorRT message list grows without bound"),
    Mutation("trt-progress-arguments-swapped", "export/engine.py",
             "def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int)",
             "def phase_start(self, parent_phase: str | None, phase_name: str, num_steps: int)",
             ("tests/test_engine_network.py",), "build-engine shows no progress bar"),
    Mutation("trt-service-ignores-profile-batch", "serve/runtime/backends.py",
             "return capped, min([max_batch, *limits])", "return capped, max_batch",
             ("tests/test_tensorrt_runtime.py",), "the server batches more samples per execution than the engine's profiles hold"),
    Mutation("tokenizer-not-checked", "export/artifact.py",
             '    check_tokenizer(directory, manifest.get("tokenizer"))', "    pass",
             ("tests/test_artifact_trust.py",), "an edited tokenizer.json changes every answer of a server, unnoticed"),
    Mutation("triton-max-batch-beyond-profiles", "export/triton_repo.py",
             'max_batch = min(max_batch, max(p["batch"][2] for p in profiles))', "pass",
             ("tests/test_triton_repo.py",), "Triton refuses the plans: max_batch_size above the profiles' largest batch"),
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
    deps = subprocess.run([str(root / ".venv" / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)  # pip and setuptools come from .venv
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "ldlm_dependencies.pth").write_text(deps + "\n")  # every run: a reused venv follows this checkout's .venv
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index", "-e", str(repo)],
                   check=True, capture_output=True)
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
        done = subprocess.run([str(python), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *args], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=timeout_s)
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
        results.append({**asdict(m), "caught": caught, "status": status, "stage": stage, "seconds": round(seconds, 1),
                        "failing_tests": failing[:5], "output_tail": "" if caught and failing else tail[-600:]})
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
