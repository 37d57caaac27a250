"""Commands that write artifacts: the ONNX export and its verifier, TensorRT engines, a Triton repository."""

from __future__ import annotations

import argparse
import json
import os

from ldlm.cli.options import float_in, in_range, int_in
from ldlm.files import force_help
from ldlm.limits import MAX_DELAY_MS, SETTINGS

MIN_COSINE_DEFAULT_TEXT = "0.9999"  # export/quantize.py's DEFAULT_MIN_COSINE (the parser imports no torch)

OPSETS = (18, 20)  # ldlm.export.onnx_export.SUPPORTED_OPSETS, without importing torch to build the parser
MAX_WORKSPACE_MB = 1 << 20  # 1 TiB, more than any GPU has
MAX_QUEUE_DELAY_US = int(MAX_DELAY_MS * 1000)  # the same window as ldlm serve's --max-delay-ms


def _cmd_export(args: argparse.Namespace) -> None:
    # per command, not at the top: building the parser (`ldlm --help`) imports no torch
    from ldlm.export.onnx_export import export_graphs

    graphs = tuple(args.graphs.split(","))
    result = export_graphs(
        args.checkpoint,
        args.out,
        opset=args.opset,
        graphs=graphs,
        with_logits=args.with_logits,
        overwrite=args.force,
        progress=not args.quiet,
        quantize=args.quantize,
        quantize_graphs=tuple(args.quantize_graphs.split(",")),
        **({} if args.min_cosine is None else {"min_cosine": args.min_cosine}),
    )
    for verification in result.verification:
        print(verification.summary())
    print(f"wrote {result.out} (opset {args.opset}; graphs {', '.join(graphs)}; manifest {result.out / 'manifest.json'})")


def _cmd_verify_onnx(args: argparse.Namespace) -> None:
    # per command, not at the top: building the parser (`ldlm --help`) imports no torch
    from ldlm.export.onnx_export import verify_export

    results = verify_export(args.path, args.checkpoint)
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        for result in results:
            print(result.summary())
    if not all(r.passed for r in results):
        raise SystemExit(1)


def _cmd_build_engine(args: argparse.Namespace) -> None:
    # per command, not at the top: building the parser (`ldlm --help`) imports no torch
    from ldlm.export.engine_builder import BuildOptions, build_engines, plan_summary
    from ldlm.export.profiles import EngineProfile

    calibration = None
    if args.precision in ("int8", "fp8"):
        from ldlm.export.calibration import CalibrationSettings  # ONNX Runtime and torch: only for an int8/fp8 build

        calibration = CalibrationSettings(args.calibration_samples, args.calibration_length, args.calibration_seed)
    options = BuildOptions(
        precision=args.precision,
        calibration_checkpoint=args.calibration_checkpoint,
        calibration=calibration,
        profiles=tuple(EngineProfile.parse(p) for p in args.profile or ()),
        tf32=args.tf32,
        optimization_level=args.optimization_level,
        workspace_mb=args.workspace_mb,
        timing_cache=args.timing_cache,
    )
    graphs = tuple(args.graphs.split(",")) if args.graphs else None
    result = build_engines(args.onnx_dir, args.out, options, graphs, args.flavor, args.force, progress=not args.quiet)
    for manifest in result.plans.values():
        print(plan_summary(manifest))
    print(f"wrote {result.out}")


def _cmd_triton_repo(args: argparse.Namespace) -> None:
    # per command, not at the top: building the parser (`ldlm --help`) imports no torch
    from ldlm.serve.deploy.triton_repo import docker_run_line, list_models, write_triton_repo

    cc_plans = {}
    for item in args.cc_plan or ():
        cc, sep, directory = item.partition("=")
        if not sep or not cc or not directory:
            raise ValueError(f"--cc-plan {item!r} is malformed; allowed: CC=ENGINE_DIR, e.g. 8.6=engines-a10")
        cc_plans[cc] = directory
    out = write_triton_repo(
        args.source,
        args.out,
        args.max_batch,
        args.queue_delay_us,
        not args.cpu,
        cc_plans or None,
        args.max_n,
        args.force,
        graph_backend=args.graph_backend,
        precision=args.precision,
    )
    print(f"wrote {out}: models {', '.join(list_models(out))}; every config.pbtxt validated against tritonclient's schema")
    if args.graph_backend == "python":
        if not args.cpu:
            print(
                "note: instance groups are KIND_GPU, so model.py asks ONNX Runtime for CUDA and refuses to load without it; "
                "--cpu writes KIND_CPU"
            )
        print(f"run on this machine: python -P -m ldlm.serve.deploy.triton_local serve {out}   (see docs/scale-out.md)")
        return
    print("build the ldlm wheel first (ldlm_generate imports ldlm): pip wheel --no-deps -w dist .")
    print(f"run: {docker_run_line(str(out.resolve()), os.path.abspath('dist'), gpu=not args.cpu)}   (see docs/scale-out.md)")


def add_commands(sub: argparse._SubParsersAction) -> None:
    _add_export(sub)
    _add_verify_onnx(sub)
    _add_build_engine(sub)
    _add_triton_repo(sub)


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export the inference graphs to ONNX and verify them",
        description="Export encoder (input_ids, attention_mask -> latents), denoiser (x_t, t, x0_prev -> x0_hat) "
        "and decoder (latents -> token_ids [, logits]) to ONNX with the dynamo exporter, dynamic batch and "
        "sequence axes and external weight data; then verify that every nn.LayerNorm became exactly one "
        "LayerNormalization node with the module's eps, axis, scale and bias. OUT gets a manifest.json; "
        "on any failure nothing is left in OUT.",
    )
    p.add_argument("checkpoint", help="checkpoint directory")
    p.add_argument("out", help="output directory to create")
    p.add_argument("--opset", type=int, choices=OPSETS, default=18, help="ONNX opset: 18 (default) or 20 (single Gelu node)")
    p.add_argument("--graphs", default="encoder,denoiser,decoder", help="comma-separated subset (default: all three)")
    p.add_argument("--with-logits", action="store_true", help="the decoder also outputs logits (B, L, V), for parity checks")
    p.add_argument(
        "--quantize",
        choices=("int8",),
        help="also write an INT8 variant of the graphs of --quantize-graphs (ONNX Runtime dynamic quantization of the MatMul "
        "weights, per channel; every LayerNorm, RMSNorm, softmax, the time embedding and the logits stay float32), verified "
        "like the fp32 graphs; serve it with --precision int8",
    )
    p.add_argument(
        "--quantize-graphs",
        default="denoiser",
        help="with --quantize: denoiser (default) or denoiser,decoder (the int8 decoder costs tokens: its argmax margins are small)",
    )
    p.add_argument(
        "--min-cosine",
        type=float_in(0.0, 1.0),
        help="with --quantize: the int8 denoiser's worst per-sample cosine against fp32 along the default sampler's trajectory; "
        f"weight nodes whose quantization would break it stay float (default: {MIN_COSINE_DEFAULT_TEXT}; 0: quantize every weight node)",
    )
    p.add_argument("--force", action="store_true", help=force_help("export"))
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_export, out_example="onnx")  # the directory a refused OUT's message suggests


def _add_verify_onnx(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "verify-onnx",
        help="check the LayerNormalization nodes of an export",
        description="Verify an export directory (or one .onnx file in it) against the LayerNorm specs in its "
        "manifest.json, or against a checkpoint's modules with --checkpoint. Exit code 1 on failure.",
    )
    p.add_argument("path", help="export directory or .onnx file")
    p.add_argument("--checkpoint", help="compare against this checkpoint's modules instead of the manifest")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=_cmd_verify_onnx)


def _add_build_engine(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "build-engine",
        help="compile an export to TensorRT plans",
        description="Build one TensorRT plan per graph of an `ldlm export` directory, with NVIDIA TensorRT or "
        "TensorRT-RTX (which also builds without a GPU). fp16/bf16 first write a strongly typed ONNX "
        "variant that keeps LayerNorm, RMSNorm reductions, softmax and logits in FP32; int8/fp8 first write a calibrated "
        "explicit Q/DQ ONNX of the MatMul inputs (norms, softmax, time embedding and vocabulary head stay float). After parsing, every "
        "LayerNormalization must be one INormalizationLayer with the module's eps and axes, or the build "
        "fails. Each plan gets a .plan.json manifest; loading a plan elsewhere checks it.",
    )
    p.add_argument("onnx_dir", help="directory written by `ldlm export`")
    p.add_argument("out", help="output directory to create")
    p.add_argument("--flavor", choices=["tensorrt", "tensorrt_rtx"], help="default: the first installed of tensorrt, tensorrt_rtx")
    p.add_argument(
        "--precision",
        choices=["fp32", "fp16", "bf16", "int8", "fp8"],
        default="fp32",
        help="default: fp32 (TF32 off); int8, fp8 (E4M3): a calibrated explicit Q/DQ graph of the MatMuls (needs --calibration-checkpoint)",
    )
    _add_calibration_options(p)
    p.add_argument(
        "--profile",
        action="append",
        metavar="batch=MIN:OPT:MAX,seq=MIN:OPT:MAX",
        help="an optimization profile; repeat for batch buckets (default: batch=1:8:32,seq=1:128:max_seq_len)",
    )
    p.add_argument("--graphs", help="comma-separated subset of the export's graphs (default: all)")
    p.add_argument("--tf32", action="store_true", help="allow TF32 for FP32 matmuls (off by default, for parity)")
    p.add_argument("--optimization-level", type=int_in(0, 5), default=3, help="builder optimization level 0..5 (default: 3)")
    p.add_argument(
        "--workspace-mb",
        type=int_in(1, MAX_WORKSPACE_MB, " MiB"),
        help=f"workspace memory limit in MiB, 1..{MAX_WORKSPACE_MB} (default: TensorRT's)",
    )
    p.add_argument("--timing-cache", help="timing cache file to read and update, outside OUT (NVIDIA TensorRT; a no-op in TensorRT-RTX)")
    p.add_argument("--force", action="store_true", help=force_help("build-engine"))
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_build_engine, out_example="engines")  # the directory a refused OUT's message suggests


def _add_calibration_options(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group(
        "calibration (--precision int8 or fp8)",
        "The Q/DQ graph's scales come from the eager pipeline's own inputs: the denoiser's along the default sampler's "
        "trajectory at the default grid's times, the encoder's and decoder's from fixed English sentences.",
    )
    group.add_argument("--calibration-checkpoint", metavar="CKPT", help="the checkpoint the export was made from (required for int8, fp8)")
    group.add_argument("--calibration-samples", type=int_in(1, 256), default=8, help="sampler trajectories, 1..256 (default: 8)")
    group.add_argument("--calibration-length", type=int_in(1, 1 << 20), default=16, help="positions per trajectory (default: 16)")
    group.add_argument("--calibration-seed", type=int_in(0, (1 << 63) - 1), default=0, help="seed of the trajectories (default: 0)")


def _add_triton_repo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "triton-repo",
        help="write a Triton Inference Server model repository",
        description="Write a Triton model repository from an `ldlm build-engine` directory (tensorrt_plan models) or an "
        "`ldlm export` directory (onnxruntime_onnx models): encoder, denoiser and decoder with dynamic batching, "
        "instance groups and warm-up, plus the Python-backend model ldlm_generate that runs the sampling loop "
        "through BLS calls. Every config.pbtxt is validated against tritonclient's model_config schema.",
    )
    p.add_argument("source", help="`ldlm build-engine` or `ldlm export` directory")
    p.add_argument("out", help="repository directory to create")
    batch, n = SETTINGS["max_batch"], SETTINGS["max_n"]  # as ldlm serve's: the same bounds
    p.add_argument("--max-batch", type=in_range(batch), default=32, help=f"max_batch_size, {batch} (default: 32)")
    p.add_argument(
        "--queue-delay-us",
        type=int_in(0, MAX_QUEUE_DELAY_US, " microseconds"),
        default=100,
        help=f"dynamic batching max_queue_delay_microseconds, 0..{MAX_QUEUE_DELAY_US} (default: 100)",
    )
    p.add_argument("--cpu", action="store_true", help="instance groups on CPU (default: GPU)")
    p.add_argument("--cc-plan", action="append", metavar="CC=ENGINE_DIR", help="extra plans per compute capability (cc_model_filenames)")
    p.add_argument("--max-n", type=in_range(n), default=64, help=f"largest N ldlm_generate accepts, {n} (default: 64)")
    p.add_argument(
        "--graph-backend",
        choices=["native", "python"],
        default="native",
        help="native (default): tensorrt_plan / onnxruntime_onnx; python: Python-backend models running ONNX Runtime "
        "on an export (for a Triton without the ONNX Runtime backend, e.g. nvidia-pytriton's)",
    )
    p.add_argument(
        "--precision",
        choices=["fp32", "int8"],
        default="fp32",
        help="fp32 (default): the graphs as exported or built; int8: an export's INT8 variants where it has them "
        "(ldlm export --quantize int8), fp32 elsewhere. Plans keep the precision they were built in.",
    )
    p.add_argument("--force", action="store_true", help=force_help("triton-repo"))
    p.set_defaults(func=_cmd_triton_repo, out_example="triton-repo")  # the directory a refused OUT's message suggests
