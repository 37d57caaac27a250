"""Commands that measure: parity against eager PyTorch and the LayerNorm eps probes (``ldlm bench``: ldlm/cli/bench.py)."""

from __future__ import annotations

import argparse
import json

from ldlm.cli.options import STEPS, device_options, float_in, seed_int
from ldlm.export.layernorm.tolerances import gates_help
from ldlm.files import force_help
from ldlm.limits import MAX_STEPS
from ldlm.model.config import SAMPLERS
from ldlm.serve.runtime.registry import (
    CUDA_DEFAULT_PRECISION,
    DEFAULT_PRECISION,
    RUN_PRECISIONS,
    backend_help,
    backend_info,
    backend_names,
    default_backend,
    resolve_run,
)

PARITY_OUT = "parity-report"  # --out's default, and the directory a refused one's message suggests


def _cmd_parity(args: argparse.Namespace) -> None:
    # per command, not at the top: building the parser (`ldlm --help`) imports no torch
    from ldlm.serve.checks.parity import run_parity
    from ldlm.serve.checks.parity_report import write_parity_report

    backend, precision = resolve_run(args.device, args.backend, args.precision)  # what `ldlm serve` runs
    # the artifact the backend runs; the torch backends run the checkpoint itself
    source = {"engines": args.engine_dir, "export": args.onnx_dir}.get(backend_info(backend).opens)
    report = run_parity(
        args.checkpoint,
        backend,
        precision,
        source,
        bisect=args.bisect,
        seed=args.seed,
        steps=args.steps,
        progress=not args.quiet,
        device=args.device,
        provider=args.provider,
        sampler=args.sampler,
        save_inputs=args.save_inputs,
        load_inputs=args.load_inputs,
        save_outputs=args.save_outputs,
        overwrite=args.force,
    )
    if args.min_token_agreement is not None:
        report.accept_token_agreement(args.min_token_agreement, "--min-token-agreement")
    files = write_parity_report(report, args.out, args.force)
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
    for what, path in (("inputs", args.save_inputs), ("outputs", args.save_outputs)):
        if path is not None:
            print(f"{what}: {path}")
    if not report.passed:
        raise SystemExit(1)


def _cmd_probe_eps(args: argparse.Namespace) -> None:
    # per command, not at the top: building the parser (`ldlm --help`) imports no torch
    from ldlm.export.layernorm.eps_probe import write_eps_report
    from ldlm.serve.checks.eps_probe_artifact import probe_layer_norm_eps

    report = probe_layer_norm_eps(
        args.checkpoint, args.onnx_dir, args.engine_dir, seed=args.seed, flavor=args.flavor, progress=not args.quiet
    )
    if args.out:
        print(f"wrote {', '.join(str(f) for f in write_eps_report(report, args.out, args.force))}")
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


def add_commands(sub: argparse._SubParsersAction) -> None:
    _add_parity(sub)
    _add_probe_eps(sub)


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
        choices=backend_names(),
        default=None,
        help=f"{backend_help()}; the torch backends run on --device (default: what `ldlm serve` runs, "
        f"{default_backend('cuda')} with --device cuda, else {default_backend()})",
    )
    p.add_argument(
        "--precision",
        choices=RUN_PRECISIONS,
        default=None,
        help="sets the gate, and the precision of the torch backends (default: what `ldlm serve` runs, "
        f"{CUDA_DEFAULT_PRECISION} for a torch backend on --device cuda, else {DEFAULT_PRECISION}); int8: ort on the export's INT8 "
        f"variants. The gates: {gates_help().replace('%', '%%')}",  # argparse formats help with %
    )
    p.add_argument(
        "--min-token-agreement",
        type=float_in(0.0, 1.0, low_open=True),
        default=None,
        metavar="SHARE",
        help="the end-to-end (and decoder) token agreement to require, in (0, 1], in place of the precision's gate above; "
        "the report notes it (default: the precision's gate)",
    )
    p.add_argument("--onnx-dir", help="ort: an `ldlm export` directory (default: export the checkpoint to a temporary one)")
    p.add_argument("--engine-dir", help="trt: an `ldlm build-engine` directory (required for trt)")
    device_options(p, precision=False)
    p.add_argument(
        "--out", default=PARITY_OUT, help=f"report directory to create; an existing one only with --force (default: {PARITY_OUT})"
    )
    p.add_argument("--force", action="store_true", help=f"{force_help('parity')}; the same for --save-inputs and --save-outputs FILE")
    p.add_argument("--bisect", action="store_true", help="on failure, name the first diverging LayerNorm")
    p.add_argument("--seed", type=seed_int, help="seed of the inputs and the generation noise (default: 0; --load-inputs: the file's)")
    p.add_argument(
        "--steps",
        type=STEPS,
        help=f"end-to-end sampler steps, 1..{MAX_STEPS} (default: 10; int8: the config's default; --load-inputs: the file's)",
    )
    p.add_argument(
        "--sampler",
        choices=SAMPLERS,
        help="solver of the end-to-end check; both sides draw the same CPU noise (default: ddim; int8: the config's default sampler; "
        "--load-inputs: the file's)",
    )
    _add_parity_files(p)
    p.add_argument("--verbose", action="store_true", help="print every comparison, not just failures")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_parity, out_example=PARITY_OUT)


def _add_parity_files(p: argparse.ArgumentParser) -> None:
    files = p.add_argument_group("inputs and outputs as files (safetensors with a JSON header; never pickle)")
    files.add_argument(
        "--save-inputs",
        metavar="FILE",
        help="write every input this run uses (each graph's input sets, the eps probes' rows, the end-to-end seeds and "
        "prior noise) to FILE, before the comparisons run. An existing FILE is replaced only with --force, and only one "
        "--save-inputs wrote; none inside a checkpoint, an ldlm output directory or --out",
    )
    files.add_argument(
        "--load-inputs",
        metavar="FILE",
        help="run on the inputs of FILE (from --save-inputs, on this backend or another) with its seed, steps and sampler; "
        "refused when FILE does not fit the checkpoint",
    )
    files.add_argument(
        "--save-outputs",
        metavar="FILE",
        help="write both sides' outputs (eager's and the backend's) to FILE. An existing FILE is replaced only with --force, "
        "and only one --save-outputs wrote; none inside a checkpoint, an ldlm output directory or --out",
    )


def _add_probe_eps(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "probe-eps",
        help="run every LayerNorm alone where eps decides, and report its implied eps",
        description="Run each LayerNormalization node of an export (ONNX Runtime: a one-node ONNX with the node's "
        "attributes, scale and bias) or each INormalizationLayer of an engine set (TensorRT: a one-layer engine) on "
        "rows where eps decides the output (variance 1e-7..1e-4, constant rows, mean 1e4 with a small variance), "
        "against torch's layer_norm with the checkpoint module's eps; solve the implied eps from the outputs; also "
        "run 8 fixed LayerNorm cases with known outputs. Exit code 0 passed, 1 failed, 3 not run (TensorRT "
        "without a GPU: the one-layer engines are built and their eps read back, not executed).",
    )
    p.add_argument("checkpoint", help="checkpoint directory (the modules' eps, weight and bias)")
    p.add_argument(
        "--onnx-dir", help="an `ldlm export` directory (ONNX Runtime); with --engine-dir: where the ONNX the plans were built from is"
    )
    p.add_argument("--engine-dir", help="an `ldlm build-engine` directory (TensorRT; runs on a GPU)")
    p.add_argument("--flavor", choices=["tensorrt", "tensorrt_rtx"], help="TensorRT flavour (default: the plans' own)")
    p.add_argument("--seed", type=seed_int, default=0, help="seed of the probe rows (default: 0)")
    p.add_argument(
        "--out", help="also write eps_probes.json and eps_probes.md into this directory, to create; an existing one only with --force"
    )
    p.add_argument("--force", action="store_true", help=force_help("probe-eps"))
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_probe_eps, out_example="eps-probes")  # the directory a refused --out's message suggests
