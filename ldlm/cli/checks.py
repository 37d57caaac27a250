"""Commands that measure: parity against eager PyTorch, the LayerNorm eps probes, benchmarks."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ldlm.cli.options import capped_positive_int, capped_positive_int_list, device_options, float_in, int_in, seed_int
from ldlm.config import INT_RANGES, SAMPLERS
from ldlm.limits import MAX_N, MAX_STEPS
from ldlm.serve.api.setting_ranges import MAX_THREADS, SETTING_RANGES

# The same caps as `ldlm serve` and `ldlm generate` where the bench does what they do; its own otherwise.
# The same caps as `ldlm serve` and `ldlm generate` where the bench does what they do; its own otherwise.
# A length is checked against the checkpoint's max_seq_len before any work; here, against any config's.
STEPS = capped_positive_int(MAX_STEPS, " denoising steps (as ldlm serve's max_steps)")
MAX_LENGTH = INT_RANGES["max_seq_len"][1]
TOKENS = " tokens (the largest max_seq_len a config may have)"
MAX_RUNS = 10_000  # timed runs per cell: p99 is stable long before this
MAX_WORKLOAD_REQUESTS = 10_000
MAX_RATE_PER_S = 1e6


def _cmd_parity(args: argparse.Namespace) -> None:
    # per command, not at the top: building the parser (`ldlm --help`) imports no torch
    from ldlm.serve.checks.parity import run_parity
    from ldlm.serve.checks.parity_report import write_parity_report

    source = {"trt": args.engine_dir, "ort": args.onnx_dir}.get(args.backend)  # torch backends run the checkpoint
    report = run_parity(
        args.checkpoint,
        args.backend,
        args.precision,
        source,
        bisect=args.bisect,
        seed=args.seed,
        steps=args.steps,
        progress=not args.quiet,
        device=args.device,
        provider=args.provider,
        sampler=args.sampler,
    )
    files = write_parity_report(report, args.out)
    for comparison in [*report.graphs, *report.layer_norms]:
        if args.verbose or not comparison.passed:
            print(comparison.summary())
    for verification in report.verification:
        if args.verbose or not verification.passed:
            print(verification.summary())
    if report.eps_probes is not None:
        for probe in report.eps_probes.layer_norms:
            if args.verbose or probe.problems:
                print(probe.summary())
        print(report.eps_probes.summary())
    print(report.summary())
    print(f"reports: {', '.join(str(f) for f in files)}")
    if not report.passed:
        raise SystemExit(1)


def _cmd_probe_eps(args: argparse.Namespace) -> None:
    # per command, not at the top: building the parser (`ldlm --help`) imports no torch
    from ldlm.serve.checks.eps_probe import write_eps_report
    from ldlm.serve.checks.eps_probe_artifact import probe_layer_norm_eps

    report = probe_layer_norm_eps(
        args.checkpoint, args.onnx_dir, args.engine_dir, seed=args.seed, flavor=args.flavor, progress=not args.quiet
    )
    if args.out:
        print(f"wrote {', '.join(str(f) for f in write_eps_report(report, args.out))}")
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.table())
        for probe in report.layer_norms:
            if probe.problems:
                print(probe.summary())
        for case in report.cases:
            for problem in case.problems:
                print(f"FAILED case {case.case} ({case.dtype}): {problem}")
        for line in [*report.problems, *(f"not exercised: {n}" for n in report.not_exercised)]:
            print(line)
        print(report.summary())
    if report.status != "PASSED":
        raise SystemExit(1 if report.status == "FAILED" else 3)


def _cmd_bench(args: argparse.Namespace) -> None:
    # per command, not at the top: building the parser (`ldlm --help`) imports no torch
    from ldlm.files import write_atomically
    from ldlm.serve.checks.bench import run_bench
    from ldlm.serve.checks.bench_latency import busy_machine_warning, parse_solver_specs
    from ldlm.serve.checks.bench_report import bench_summary, plot_bench

    warning = busy_machine_warning(args.threads)
    if warning:
        print(f"ldlm bench: warning: {warning}", file=sys.stderr)
    report = run_bench(
        args.checkpoint,
        args.backends.split(","),
        args.onnx_dir,
        args.engine_dir,
        args.batches,
        args.length,
        args.runs,
        args.threads,
        args.gen_n,
        args.gen_steps,
        args.workload_requests,
        args.workload_rate,
        args.workload_backend,
        args.max_batch,
        progress=not args.quiet,
        workload_lengths=args.workload_lengths,
        device=args.device,
        precision=args.precision,
        provider=args.provider,
        gen_sampler=args.gen_sampler,
        solver_specs=parse_solver_specs(args.solvers),
        solver_reference_steps=args.solver_reference_steps,
        ort_precisions=args.precisions.split(","),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomically(out / "bench.json", json.dumps(report, indent=2) + "\n")
    plot_bench(report, str(out / "bench.png"))
    print("\n".join(bench_summary(report)))
    print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")


def add_commands(sub: argparse._SubParsersAction) -> None:
    _add_parity(sub)
    _add_probe_eps(sub)
    _add_bench(sub)


def _add_parity(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "parity",
        help="check an engine against eager PyTorch",
        description="Compare ONNX Runtime or TensorRT against eager PyTorch on the checkpoint: every graph output "
        "on random, padded and stress inputs (max/mean/p99 abs and rel error, cosine per sample, NaN/Inf, "
        "elementwise pass/fail at the precision's atol and rtol); every LayerNorm output (ONNX Runtime); and "
        "end-to-end generation with the deterministic sampler as token agreement; for ort and trt, every LayerNorm run "
        "alone where eps decides (as `ldlm probe-eps`). Given --onnx-dir or --engine-dir, the structural verifier runs first. "
        "Writes parity.json, parity.md and PNG plots. Exit code 1 on failure.",
    )
    p.add_argument("checkpoint", help="checkpoint directory (the eager reference)")
    p.add_argument(
        "--backend",
        choices=["ort", "trt", "eager", "compiled", "inductor"],
        default="ort",
        help="ort, trt, or torch on --device: eager, compiled (shape buckets + CUDA graphs), inductor (compiled, "
        "plus torch.compile's fused kernels) (default: ort)",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "fp16", "bf16", "int8"],
        default="fp32",
        help="sets atol/rtol, and the dtype of the torch backends (default: fp32); int8: ort on the export's INT8 "
        "variants, judged by cosine and token agreement (thresholds in the report)",
    )
    p.add_argument("--onnx-dir", help="ort: an `ldlm export` directory (default: export the checkpoint to a temporary one)")
    p.add_argument("--engine-dir", help="trt: an `ldlm build-engine` directory (required for trt)")
    device_options(p, precision=False)
    p.add_argument("--out", default="parity-report", help="report directory (default: parity-report)")
    p.add_argument("--bisect", action="store_true", help="on failure, name the first diverging LayerNorm")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the inputs and the generation noise (default: 0)")
    p.add_argument("--steps", type=STEPS, help=f"end-to-end sampler steps, 1..{MAX_STEPS} (default: 10; int8: the config's default)")
    p.add_argument(
        "--sampler",
        choices=SAMPLERS,
        help="solver of the end-to-end check; both sides draw the same CPU noise (default: ddim; int8: the config's default sampler)",
    )
    p.add_argument("--verbose", action="store_true", help="print every comparison, not just failures")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_parity)


def _add_probe_eps(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "probe-eps",
        help="run every LayerNorm alone where eps decides, and report its implied eps",
        description="Run each LayerNormalization node of an export (ONNX Runtime: a one-node ONNX with the node's "
        "attributes, scale and bias) or each INormalizationLayer of an engine set (TensorRT: a one-layer engine) on "
        "rows where eps decides the output (variance 1e-7..1e-4, constant rows, mean 1e4 with a small variance), "
        "against torch's layer_norm with the checkpoint module's eps; solve the implied eps from the outputs; also "
        "run the 8 fixed cases of the LayerNorm design page. Exit code 0 passed, 1 failed, 3 not run (TensorRT "
        "without a GPU: the one-layer engines are built and their eps read back, not executed).",
    )
    p.add_argument("checkpoint", help="checkpoint directory (the modules' eps, weight and bias)")
    p.add_argument(
        "--onnx-dir", help="an `ldlm export` directory (ONNX Runtime); with --engine-dir: where the ONNX the plans were built from is"
    )
    p.add_argument("--engine-dir", help="an `ldlm build-engine` directory (TensorRT; runs on a GPU)")
    p.add_argument("--flavor", choices=["tensorrt", "tensorrt_rtx"], help="TensorRT flavour (default: the plans' own)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the probe rows (default: 0)")
    p.add_argument("--out", help="also write eps_probes.json and eps_probes.md into this directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_probe_eps)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="latency and throughput: eager, ONNX Runtime and TensorRT side by side",
        description="Benchmark every graph on every backend at each batch size (p50/p99 latency, throughput), "
        "end-to-end generation tokens/s, and continuous against static batching under a mixed-arrival workload "
        "(requests of different lengths and step counts arriving over time). Backends alternate run by run. "
        "Writes OUT/bench.json and OUT/bench.png.",
    )
    p.add_argument("checkpoint", help="checkpoint directory")
    p.add_argument("--backends", default="eager,ort", help="comma-separated: eager, compiled, inductor, ort, trt (default: eager,ort)")
    p.add_argument("--onnx-dir", help="export to use for ort (default: export the checkpoint to a temporary one)")
    p.add_argument(
        "--precisions",
        default="fp32",
        help="comma-separated ort precisions, each its own column side by side: fp32 (ort), int8 (ort-int8: the INT8 "
        "variants, exported with them when no --onnx-dir is given), fp16 (default: fp32)",
    )
    p.add_argument("--engine-dir", help="engines to use for trt")
    p.add_argument(
        "--batches",
        type=capped_positive_int_list(MAX_N, " samples per execution (as ldlm serve's max_n)"),
        default=[1, 8],
        help=f"comma-separated batch sizes, each 1..{MAX_N} (default: 1,8)",
    )
    p.add_argument(
        "--length",
        type=capped_positive_int(MAX_LENGTH, TOKENS),
        default=128,
        help="sequence length, at most the config's max_seq_len (default: 128)",
    )
    p.add_argument(
        "--runs",
        type=capped_positive_int(MAX_RUNS, " timed runs per cell"),
        default=10,
        help=f"timed runs per cell, 1..{MAX_RUNS} (default: 10)",
    )
    p.add_argument(
        "--threads",
        type=int_in(1, MAX_THREADS, " threads"),
        default=2,
        help=f"threads for torch and ONNX Runtime, 1..{MAX_THREADS} (default: 2)",
    )
    p.add_argument(
        "--gen-n",
        type=capped_positive_int(MAX_N, " samples per run (as ldlm serve's max_n)"),
        default=4,
        help=f"samples per generation run, 1..{MAX_N} (default: 4)",
    )
    _bench_generation_options(p)
    device_options(p)
    p.add_argument("--out", default="runs/bench", help="output directory (default: runs/bench)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_bench)


def _bench_generation_options(p: argparse.ArgumentParser) -> None:
    """bench's generation runs, solver comparison and mixed-arrival workload."""
    p.add_argument("--gen-steps", type=STEPS, default=10, help=f"steps per generation run, 1..{MAX_STEPS} (default: 10)")
    p.add_argument("--gen-sampler", choices=SAMPLERS, default="ddim", help="solver of the generation runs (default: ddim)")
    p.add_argument(
        "--solvers",
        default="ddim@50,dpm3m-psc@21,dpm3m-psc@15",
        help=f"NAME@STEPS[:GRID] list (STEPS 1..{MAX_STEPS}; GRID tuned, uniform, power or logsnr): latency per sample beside "
        "token agreement and latent error against a long DDIM run, side by side on the workload backend; '' skips "
        "(default: ddim@50,dpm3m-psc@21,dpm3m-psc@15)",
    )
    p.add_argument(
        "--solver-reference-steps", type=STEPS, default=500, help=f"DDIM steps of the solvers' reference, 1..{MAX_STEPS} (default: 500)"
    )
    p.add_argument(
        "--workload-requests",
        type=int_in(0, MAX_WORKLOAD_REQUESTS, " requests (0 skips the workload)"),
        default=60,
        help=f"requests in the mixed-arrival workload, 0..{MAX_WORKLOAD_REQUESTS}; 0 skips it (default: 60)",
    )
    p.add_argument(
        "--workload-rate",
        type=float_in(0, MAX_RATE_PER_S, " arrivals per second", low_open=True),
        default=20.0,
        help="mean arrivals per second, in (0, 1000000] (default: 20)",
    )
    p.add_argument("--workload-backend", default="ort", help="backend for the workload (default: ort)")
    p.add_argument(
        "--workload-lengths",
        type=capped_positive_int_list(MAX_LENGTH, TOKENS),
        default=[16, 32, 64, 128],
        help="request lengths drawn from; those above the config's max_seq_len are dropped (default: 16,32,64,128)",
    )
    low, high = SETTING_RANGES["max_batch"]
    p.add_argument(
        "--max-batch",
        type=int_in(low, high, " samples per execution (as ldlm serve's max_batch)"),
        default=8,
        help=f"scheduler batch size, {low}..{high} (default: 8)",
    )
