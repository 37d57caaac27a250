"""``ldlm bench``: latency of every graph per backend, generation, solvers side by side and a mixed-arrival
workload, into OUT/bench.json and OUT/bench.png."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ldlm.cli.options import STEPS, add_prior_temperature, capped_positive_int, capped_positive_int_list, device_options, float_in, int_in
from ldlm.files import force_help
from ldlm.limits import MAX_N, MAX_STEPS, MAX_THREADS, SETTINGS
from ldlm.model.config import INT_RANGES, SAMPLERS
from ldlm.serve.runtime.registry import DEFAULT_BACKEND, REFERENCE_BACKEND, backend_names, default_backend, resolve_run

# The same caps as `ldlm serve` and `ldlm generate` where the bench does what they do; its own otherwise.
# A length is checked against the checkpoint's max_seq_len before any work; here, against any config's.
MAX_LENGTH = INT_RANGES["max_seq_len"][1]
TOKENS = " tokens (the largest max_seq_len a config may have)"
BENCH_OUT = "runs/bench"  # --out's default, and the directory a refused one's message suggests
MAX_RUNS = 10_000  # timed runs per cell: p99 is stable long before this
MAX_WORKLOAD_REQUESTS = 10_000
MAX_RATE_PER_S = 1e6


def default_backends(device: str) -> list[str]:
    """What bench times when no --backends are named: the reference, ONNX Runtime (it runs everywhere) and what
    `ldlm serve` runs on ``device``, each once."""
    return list(dict.fromkeys([REFERENCE_BACKEND, DEFAULT_BACKEND, resolve_run(device)[0]]))


def backends_help() -> str:
    return (
        f"comma-separated: {', '.join(backend_names())} (default: {','.join(default_backends('cpu'))}, and with "
        f"--device cuda {','.join(default_backends('cuda'))}: what `ldlm serve` runs there too)"
    )


def _cmd_bench(args: argparse.Namespace) -> None:
    # per command, not at the top: building the parser (`ldlm --help`) imports no torch
    from ldlm.files import atomic_directory, command_writer
    from ldlm.serve.checks.bench import run_bench
    from ldlm.serve.checks.bench_latency import busy_machine_warning, default_threads, parse_solver_specs
    from ldlm.serve.checks.bench_report import bench_summary, plot_bench

    backends = args.backends.split(",") if args.backends else default_backends(args.device)
    threads = args.threads or default_threads()
    warning = busy_machine_warning(threads)
    if warning:
        print(f"ldlm bench: warning: {warning}", file=sys.stderr)
    report = run_bench(
        args.checkpoint,
        backends,
        args.onnx_dir,
        args.engine_dir,
        args.batches,
        args.length,
        args.runs,
        threads,
        args.gen_n,
        args.gen_steps,
        args.workload_requests,
        args.workload_rate,
        args.workload_backend or resolve_run(args.device)[0],
        args.max_batch,
        progress=not args.quiet,
        workload_lengths=args.workload_lengths,
        device=args.device,
        precision=resolve_run(args.device, REFERENCE_BACKEND, args.precision)[1],  # every torch backend's, as `ldlm serve` runs it
        provider=args.provider,
        gen_sampler=args.gen_sampler,
        solver_specs=parse_solver_specs(args.solvers),
        solver_reference_steps=args.solver_reference_steps,
        ort_precisions=args.precisions.split(","),
        prior_temperature=args.prior_temperature,
    )
    out = Path(args.out)
    with atomic_directory(out, args.force, command_writer("bench")) as tmp:  # both files or neither, recorded as bench's
        (tmp / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
        plot_bench(report, str(tmp / "bench.png"))
    print("\n".join(bench_summary(report)))
    print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    if not report["reliable"]:
        print(
            f"ldlm bench: warning: the figures are unreliable ({report['unreliable_reason']}); bench.json says reliable: false "
            "and leaves out the speed-up ratios. Run it on a quiet machine, or with fewer --threads",
            file=sys.stderr,
        )


def add_commands(sub: argparse._SubParsersAction) -> None:
    _add_bench(sub)


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
    p.add_argument("--backends", default=None, help=backends_help())
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
        default=None,
        help=f"threads for torch and ONNX Runtime, 1..{MAX_THREADS} (default: the CPUs this process may use that the "
        "1-minute load average leaves free, at least 1, so the bench does not oversubscribe them). A run on oversubscribed "
        "CPUs writes reliable: false and the reason into bench.json, and leaves out its speed-up ratios",
    )
    p.add_argument(
        "--gen-n",
        type=capped_positive_int(MAX_N, " samples per run (as ldlm serve's max_n)"),
        default=4,
        help=f"samples per generation run, 1..{MAX_N} (default: 4)",
    )
    _bench_generation_options(p)
    device_options(p)
    p.add_argument("--out", default=BENCH_OUT, help=f"output directory to create; an existing one only with --force (default: {BENCH_OUT})")
    p.add_argument("--force", action="store_true", help=force_help("bench"))
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_bench, out_example=BENCH_OUT)


def _bench_generation_options(p: argparse.ArgumentParser) -> None:
    """bench's generation runs, solver comparison and mixed-arrival workload."""
    p.add_argument("--gen-steps", type=STEPS, default=10, help=f"steps per generation run, 1..{MAX_STEPS} (default: 10)")
    p.add_argument("--gen-sampler", choices=SAMPLERS, default="ddim", help="solver of the generation runs (default: ddim)")
    add_prior_temperature(p)  # the generation and solver runs, and their reference
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
    p.add_argument(
        "--workload-backend",
        default=None,
        help=f"backend for the workload (default: what `ldlm serve` runs, {default_backend('cuda')} with --device cuda, "
        f"else {default_backend()}); not among --backends: the last of them",
    )
    p.add_argument(
        "--workload-lengths",
        type=capped_positive_int_list(MAX_LENGTH, TOKENS),
        default=[16, 32, 64, 128],
        help="request lengths drawn from; those above the config's max_seq_len are dropped (default: 16,32,64,128)",
    )
    low, high = int(SETTINGS["max_batch"].low), int(SETTINGS["max_batch"].high)
    p.add_argument(
        "--max-batch",
        type=int_in(low, high, " samples per execution (as ldlm serve's max_batch)"),
        default=8,
        help=f"scheduler batch size, {low}..{high} (default: 8)",
    )
