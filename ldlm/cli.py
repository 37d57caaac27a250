"""The ``ldlm`` command line: one thin subcommand per stage of the Python API."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from ldlm import __version__


def _cmd_init(args: argparse.Namespace) -> None:
    from tqdm.auto import tqdm

    from ldlm.checkpoint import init_model, refuse_existing, save_checkpoint
    from ldlm.config import preset
    from ldlm.tokenizer import TextTokenizer

    refuse_existing(args.out, args.force)  # before the model is built, which takes a while at base size
    config = preset(args.preset)
    with tqdm(total=3, desc="init", unit="stage", disable=args.quiet) as bar:
        bar.set_postfix_str("building the model")
        model = init_model(config, args.seed, args.gpt2_dir, norm_init=args.norm_init)
        bar.update()
        bar.set_postfix_str("loading the tokenizer")
        tokenizer = TextTokenizer.from_directory(args.tokenizer_dir) if args.tokenizer_dir else TextTokenizer.gpt2()
        bar.update()
        bar.set_postfix_str("writing the checkpoint")
        save_checkpoint(model, tokenizer, args.out, overwrite=args.force)
        bar.update()
    weights = "GPT-2 from " + str(args.gpt2_dir) if args.gpt2_dir else "random GPT-2"
    print(f"wrote {args.out} (preset {args.preset}, seed {args.seed}, {weights}, norm init {args.norm_init})")


def _cmd_generate(args: argparse.Namespace) -> None:
    from ldlm.pipeline import LDLMPipeline

    pipeline = LDLMPipeline.from_checkpoint(args.checkpoint, args.device)
    start = time.perf_counter()
    result = pipeline.generate(
        args.n, args.length, args.steps, args.seed, args.sampler, args.t_min, progress=not args.quiet
    )
    elapsed = time.perf_counter() - start
    if args.json:
        print(json.dumps({"texts": result.texts, "token_ids": result.ids(), "seconds": elapsed}))
        return
    for i, text in enumerate(result.texts):
        print(f"[{i}] {text!r}")
    print(f"generated {args.n} x {args.length} tokens in {elapsed:.2f} s", file=sys.stderr)


def _cmd_reconstruct(args: argparse.Namespace) -> None:
    from ldlm.pipeline import LDLMPipeline

    pipeline = LDLMPipeline.from_checkpoint(args.checkpoint, args.device)
    result = pipeline.reconstruct(args.texts)
    if args.json:
        print(json.dumps({"texts": result.texts, "token_ids": result.ids()}))
        return
    for source, text in zip(args.texts, result.texts):
        print(f"{source!r} -> {text!r}")


def _cmd_export(args: argparse.Namespace) -> None:
    from ldlm.export.onnx_export import export_graphs

    graphs = tuple(args.graphs.split(","))
    result = export_graphs(
        args.checkpoint, args.out, opset=args.opset, graphs=graphs, with_logits=args.with_logits,
        overwrite=args.force, progress=not args.quiet,
    )
    for verification in result.verification:
        print(verification.summary())
    print(f"wrote {result.out} (opset {args.opset}; graphs {', '.join(graphs)}; manifest {result.out / 'manifest.json'})")


def _cmd_verify_onnx(args: argparse.Namespace) -> None:
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
    from ldlm.export.engine import BuildOptions, build_engines, plan_summary
    from ldlm.export.profiles import EngineProfile

    options = BuildOptions(
        precision=args.precision,
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


def _cmd_parity(args: argparse.Namespace) -> None:
    from ldlm.serve.checks.parity import run_parity
    from ldlm.serve.checks.parity_report import write_parity_report

    source = {"trt": args.engine_dir, "ort": args.onnx_dir}.get(args.backend)  # torch backends run the checkpoint
    report = run_parity(args.checkpoint, args.backend, args.precision, source, bisect=args.bisect, seed=args.seed,
                        steps=args.steps, progress=not args.quiet, device=args.device, provider=args.provider)
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
    from ldlm.serve.checks.eps_probe import probe_layer_norm_eps, write_eps_report

    if args.onnx_dir is None and args.engine_dir is None:
        raise ValueError("an artifact is needed; allowed: --onnx-dir DIR (ONNX Runtime) or --engine-dir DIR (TensorRT)")
    report = probe_layer_norm_eps(args.checkpoint, args.onnx_dir, args.engine_dir, seed=args.seed, flavor=args.flavor,
                                  progress=not args.quiet)
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
    from pathlib import Path

    from ldlm.serve.checks.bench import bench_summary, plot_bench, run_bench

    report = run_bench(
        args.checkpoint, args.backends.split(","), args.onnx_dir, args.engine_dir, args.batches,
        args.length, args.runs, args.threads, args.gen_n, args.gen_steps, args.workload_requests, args.workload_rate,
        args.workload_backend, args.max_batch, progress=not args.quiet, workload_lengths=args.workload_lengths,
        device=args.device, precision=args.precision, provider=args.provider,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2) + "\n")
    plot_bench(report, str(out / "bench.png"))
    print("\n".join(bench_summary(report)))
    print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")


def _cmd_serve(args: argparse.Namespace) -> None:
    import os

    from ldlm.serve.api.server import ServerSettings, serve

    settings = ServerSettings(
        host=args.host, port=args.port, backend=args.backend, max_batch=args.max_batch, max_delay_ms=args.max_delay_ms,
        max_queue=args.max_queue, request_timeout_s=args.timeout_s, max_body_bytes=args.max_body_mb << 20,
        api_key=args.api_key or os.environ.get("LDLM_API_KEY") or None, threads=args.threads,
        device=args.device, precision=args.precision, provider=args.provider,
        max_request_samples=args.max_request_samples, max_request_tokens=args.max_request_tokens,
        header_timeout_s=args.header_timeout_s, body_timeout_s=args.body_timeout_s, max_connections=args.max_connections,
        preview_budget=args.preview_budget, trt_cuda_graphs=args.trt_cuda_graphs,
    )
    if args.ray:
        try:
            from ldlm.serve.deploy.ray_app import RayOptions, parse_autoscale, run_on_ray
        except ImportError as error:
            raise RuntimeError(f"--ray needs Ray Serve: pip install 'ldlm[ray]' ({error})") from None
        low, high = parse_autoscale(args.autoscale) if args.autoscale else (None, None)
        options = RayOptions(replicas=args.replicas or max(low or 1, 1), min_replicas=low, max_replicas=high,
                             num_cpus=1.0 if args.replica_cpus is None else args.replica_cpus, num_gpus=args.replica_gpus or 0.0)
        run_on_ray(args.source, settings, options, args.ray_address)
        return
    ray_only = {"--ray-address": args.ray_address, "--replicas": args.replicas, "--autoscale": args.autoscale,
                "--replica-cpus": args.replica_cpus, "--replica-gpus": args.replica_gpus}
    if any(value is not None for value in ray_only.values()):
        raise ValueError(f"{', '.join(f for f, v in ray_only.items() if v is not None)} only apply with --ray")
    serve(args.source, settings, args.log_level)


def _cmd_triton_repo(args: argparse.Namespace) -> None:
    from ldlm.export.triton_repo import list_models, write_triton_repo

    cc_plans = {}
    for item in args.cc_plan or ():
        cc, sep, directory = item.partition("=")
        if not sep or not cc or not directory:
            raise ValueError(f"--cc-plan {item!r} is malformed; allowed: CC=ENGINE_DIR, e.g. 8.6=engines-a10")
        cc_plans[cc] = directory
    out = write_triton_repo(args.source, args.out, args.max_batch, args.queue_delay_us, not args.cpu, cc_plans or None,
                            args.max_n, args.force)
    print(f"wrote {out}: models {', '.join(list_models(out))}; every config.pbtxt validated against tritonclient's schema")
    print(f"run: docker run --gpus all --rm -p8000:8000 -p8001:8001 -p8002:8002 -v {out.resolve()}:/models "
          "nvcr.io/nvidia/tritonserver:<xx.yy>-py3 tritonserver --model-repository=/models   (see docs/scale-out.md)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer (1, 2, ...), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is out of range; allowed: an integer >= 1")
    return value


def _positive_int_list(text: str) -> list[int]:
    try:
        values = [int(item) for item in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers (e.g. 1,8), got {text!r}")
    return values


def _device_options(p: argparse.ArgumentParser, precision: bool = True) -> None:
    """--device and --precision for the torch backends, --provider for ONNX Runtime."""
    p.add_argument("--device", default="cpu", help="torch backends (eager, compiled): cpu, cuda or cuda:N (default: cpu)")
    if precision:
        p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                       help="torch backends' dtype; LayerNorm, RMSNorm, softmax and logits stay FP32 (default: fp32)")
    p.add_argument("--provider", choices=["cpu", "cuda", "tensorrt"], default="cpu",
                   help="ONNX Runtime execution provider; cuda and tensorrt need onnxruntime-gpu (default: cpu)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ldlm",
        description="LDLM latent diffusion language model, from PyTorch to production inference: checkpoints, "
        "generation, ONNX export and verification, TensorRT engines, parity checks, benchmarks and serving. "
        "Typical flow: init -> export -> build-engine -> parity -> serve (or triton-repo).",
    )
    parser.add_argument("--version", action="version", version=f"ldlm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "init",
        help="write a seeded random-init checkpoint",
        description="Write a checkpoint directory (config.json, model.safetensors, tokenizer.json) with "
        "seeded random weights. GPT-2 weights come from --gpt2-dir when given; nothing is downloaded. "
        "Random weights generate gibberish: this is for testing the tool chain, not for text quality.",
    )
    p.add_argument("out", help="checkpoint directory to create")
    p.add_argument("--preset", choices=["tiny", "base"], default="tiny", help="model size (default: tiny)")
    p.add_argument("--seed", type=int, default=0, help="initialization seed (default: 0)")
    p.add_argument("--gpt2-dir", help="local Hugging Face GPT-2 directory (config.json + model.safetensors)")
    p.add_argument("--norm-init", choices=["default", "random"], default="default",
                   help="random: every LayerNorm/RMSNorm scale and bias and the feature/latent mean and std get "
                   "their own seeded values, like a trained checkpoint, so parity sees a norm paired with the wrong "
                   "parameters (GPT-2 weights from --gpt2-dir are kept); default: scale 1, bias 0, identity statistics")
    p.add_argument("--tokenizer-dir", help="local tokenizer directory (default: GPT-2 BPE shipped offline)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_init)

    p = sub.add_parser(
        "generate",
        help="sample texts from a checkpoint",
        description="Sample N sequences by denoising latents from noise, then decode them to text.",
    )
    p.add_argument("checkpoint", help="checkpoint directory")
    p.add_argument("--n", type=_positive_int, default=4, help="number of samples (default: 4)")
    p.add_argument("--length", type=_positive_int, default=64, help="tokens per sample, at most the config's max_seq_len (default: 64)")
    p.add_argument("--steps", type=_positive_int, default=None, help="denoising steps (default: the config's default_steps, 50)")
    p.add_argument("--seed", type=int, default=0, help="noise seed (default: 0)")
    p.add_argument("--sampler", choices=["sde", "ddim"], default="sde",
                   help="sde: Euler-Maruyama (stochastic); ddim: deterministic given the seed (default: sde)")
    p.add_argument("--t-min", type=float, default=None, help="last time of the grid (default: the config's t_min, 0.05)")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text lines")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser(
        "reconstruct",
        help="encode texts to latents and decode them back",
        description="Run texts through the autoencoder (GPT-2 features -> latents -> tokens) and print the result.",
    )
    p.add_argument("checkpoint", help="checkpoint directory")
    p.add_argument("texts", nargs="+", help="texts to reconstruct")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text lines")
    p.set_defaults(func=_cmd_reconstruct)

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
    p.add_argument("--opset", type=int, default=18, help="ONNX opset: 18 (default) or 20 (single Gelu node)")
    p.add_argument("--graphs", default="encoder,denoiser,decoder", help="comma-separated subset (default: all three)")
    p.add_argument("--with-logits", action="store_true", help="the decoder also outputs logits (B, L, V), for parity checks")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_export)

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

    p = sub.add_parser(
        "build-engine",
        help="compile an export to TensorRT plans",
        description="Build one TensorRT plan per graph of an `ldlm export` directory, with NVIDIA TensorRT or "
        "TensorRT-RTX (which also builds without a GPU). fp16/bf16 first write a strongly typed ONNX "
        "variant that keeps LayerNorm, RMSNorm reductions, softmax and logits in FP32. After parsing, every "
        "LayerNormalization must be one INormalizationLayer with the module's eps and axes, or the build "
        "fails. Each plan gets a .plan.json manifest; loading a plan elsewhere checks it.",
    )
    p.add_argument("onnx_dir", help="directory written by `ldlm export`")
    p.add_argument("out", help="output directory to create")
    p.add_argument("--flavor", choices=["tensorrt", "tensorrt_rtx"], help="default: the first installed of tensorrt, tensorrt_rtx")
    p.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32", help="default: fp32 (TF32 off)")
    p.add_argument("--profile", action="append", metavar="batch=MIN:OPT:MAX,seq=MIN:OPT:MAX",
                   help="an optimization profile; repeat for batch buckets (default: batch=1:8:32,seq=1:128:max_seq_len)")
    p.add_argument("--graphs", help="comma-separated subset of the export's graphs (default: all)")
    p.add_argument("--tf32", action="store_true", help="allow TF32 for FP32 matmuls (off by default, for parity)")
    p.add_argument("--optimization-level", type=int, default=3, help="builder optimization level 0..5 (default: 3)")
    p.add_argument("--workspace-mb", type=int, help="workspace memory limit in MiB (default: TensorRT's)")
    p.add_argument("--timing-cache", help="timing cache file to read and update (NVIDIA TensorRT; a no-op in TensorRT-RTX)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_build_engine)

    p = sub.add_parser(
        "parity",
        help="check an engine against eager PyTorch",
        description="Compare ONNX Runtime or TensorRT against eager PyTorch on the checkpoint: every graph output "
        "on random, padded and stress inputs (max/mean/p99 abs and rel error, cosine per sample, NaN/Inf, "
        "elementwise pass/fail at the precision's atol and rtol); every LayerNorm output (ONNX Runtime); and "
        "end-to-end generation with the deterministic sampler as token agreement; every LayerNorm run alone where eps "
        "decides (as `ldlm probe-eps`). Given --onnx-dir or --engine-dir, the structural verifier runs first. "
        "Writes parity.json, parity.md and PNG plots. Exit code 1 on failure.",
    )
    p.add_argument("checkpoint", help="checkpoint directory (the eager reference)")
    p.add_argument("--backend", choices=["ort", "trt", "eager", "compiled"], default="ort",
                   help="ort, trt, or torch on --device: eager, compiled (shape buckets + CUDA graphs) (default: ort)")
    p.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp32",
                   help="sets atol/rtol, and the dtype of the torch backends (default: fp32)")
    p.add_argument("--onnx-dir", help="ort: an `ldlm export` directory (default: export the checkpoint to a temporary one)")
    p.add_argument("--engine-dir", help="trt: an `ldlm build-engine` directory (required for trt)")
    _device_options(p, precision=False)
    p.add_argument("--out", default="parity-report", help="report directory (default: parity-report)")
    p.add_argument("--bisect", action="store_true", help="on failure, name the first diverging LayerNorm")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and the generation noise")
    p.add_argument("--steps", type=_positive_int, default=10, help="sampler steps of the end-to-end check (default: 10)")
    p.add_argument("--verbose", action="store_true", help="print every comparison, not just failures")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_parity)

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
    p.add_argument("--onnx-dir", help="an `ldlm export` directory (ONNX Runtime); with --engine-dir: where the ONNX the plans were built from is")
    p.add_argument("--engine-dir", help="an `ldlm build-engine` directory (TensorRT; runs on a GPU)")
    p.add_argument("--flavor", choices=["tensorrt", "tensorrt_rtx"], help="TensorRT flavour (default: the plans' own)")
    p.add_argument("--seed", type=int, default=0, help="seed of the probe rows (default: 0)")
    p.add_argument("--out", help="also write eps_probes.json and eps_probes.md into this directory")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_probe_eps)

    p = sub.add_parser(
        "bench",
        help="latency and throughput: eager, ONNX Runtime and TensorRT side by side",
        description="Benchmark every graph on every backend at each batch size (p50/p99 latency, throughput), "
        "end-to-end generation tokens/s, and continuous against static batching under a mixed-arrival workload "
        "(requests of different lengths and step counts arriving over time). Backends alternate run by run. "
        "Writes OUT/bench.json and OUT/bench.png.",
    )
    p.add_argument("checkpoint", help="checkpoint directory")
    p.add_argument("--backends", default="eager,ort", help="comma-separated: eager, compiled, ort, trt (default: eager,ort)")
    p.add_argument("--onnx-dir", help="export to use for ort (default: export the checkpoint to a temporary one)")
    p.add_argument("--engine-dir", help="engines to use for trt")
    p.add_argument("--batches", type=_positive_int_list, default=[1, 8], help="comma-separated batch sizes (default: 1,8)")
    p.add_argument("--length", type=_positive_int, default=128, help="sequence length, at most the config's max_seq_len (default: 128)")
    p.add_argument("--runs", type=_positive_int, default=10, help="timed runs per cell (default: 10)")
    p.add_argument("--threads", type=_positive_int, default=2, help="threads for torch and ONNX Runtime (default: 2)")
    p.add_argument("--gen-n", type=_positive_int, default=4, help="samples per generation run (default: 4)")
    p.add_argument("--gen-steps", type=_positive_int, default=10, help="steps per generation run (default: 10)")
    p.add_argument("--workload-requests", type=int, default=60, help="requests in the mixed-arrival workload; 0 skips it (default: 60)")
    p.add_argument("--workload-rate", type=float, default=20.0, help="mean arrivals per second (default: 20)")
    p.add_argument("--workload-backend", default="ort", help="backend for the workload (default: ort)")
    p.add_argument("--workload-lengths", type=_positive_int_list, default=[16, 32, 64, 128],
                   help="request lengths drawn from; those above the config's max_seq_len are dropped (default: 16,32,64,128)")
    p.add_argument("--max-batch", type=_positive_int, default=8, help="scheduler batch size (default: 8)")
    _device_options(p)
    p.add_argument("--out", default="runs/bench", help="output directory (default: runs/bench)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "serve",
        help="serve the graphs over HTTP (KServe v2) and a text API",
        description="Serve KServe v2 (health, metadata, infer with JSON and binary tensors, so tritonclient works) for "
        "the encoder, denoiser and decoder graphs, plus POST /v1/generate, /v1/reconstruct and /v1/encode, with "
        "dynamic batching, continuous batching for generation, Prometheus /metrics and OpenAPI /docs. Binds "
        "127.0.0.1 unless told otherwise. SIGINT/SIGTERM finish in-flight requests before exiting.",
    )
    p.add_argument("source", help="checkpoint (eager, compiled; ort exports it first), `ldlm export` dir (ort) or `ldlm build-engine` dir (trt)")
    p.add_argument("--backend", choices=["eager", "compiled", "ort", "trt"], default="ort",
                   help="eager or compiled (shape buckets + CUDA graphs) torch on --device, ort on --provider, trt (default: ort)")
    _device_options(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="default: 8000")
    p.add_argument("--max-batch", type=_positive_int, default=16, help="samples per execution (default: 16)")
    p.add_argument("--max-delay-ms", type=float, default=0.0, help="dynamic batching window; 0 batches whatever queued during the last run (default: 0)")
    p.add_argument("--preview-budget", type=float, default=0.05, help="share of wall time that decoding streamed denoising "
                   "previews may take; previews are skipped, never queued, beyond it (default: 0.05)")
    p.add_argument("--trt-cuda-graphs", action="store_true", help="trt: replay CUDA graphs (TensorRT-RTX captures its own; "
                   "NVIDIA TensorRT: one capture per profile and shape). The compiled backend uses CUDA graphs on cuda anyway")
    p.add_argument("--max-queue", type=_positive_int, default=256, help="waiting requests per graph before 503 (default: 256)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="per-request timeout, then 504 (default: 60)")
    p.add_argument("--max-body-mb", type=_positive_int, default=8, help="request body cap, then 413 (default: 8 MiB)")
    p.add_argument("--max-request-samples", type=_positive_int, default=64, help="batch size of one /v2 infer request, then 413 (default: 64)")
    p.add_argument("--max-request-tokens", type=_positive_int, default=8192,
                   help="batch x seq of one /v2 infer request, then 413 (default: 8192)")
    p.add_argument("--header-timeout-s", type=float, default=10.0, help="a request's headers must arrive within this (default: 10)")
    p.add_argument("--body-timeout-s", type=float, default=30.0, help="a request's body must arrive within this, then 408 (default: 30)")
    p.add_argument("--max-connections", type=_positive_int, default=1024,
                   help="open connections; above it the oldest idle one is closed, and if all are busy a new one gets 503 (default: 1024)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY'. Prefer the LDLM_API_KEY environment variable: "
                   "a command-line key is visible to every user in the process list. Off by default")
    p.add_argument("--threads", type=int, help="ONNX Runtime intra-op threads (default: its own)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="level of the JSON request log on stderr; info logs one line per request (default: info)")
    ray = p.add_argument_group("Ray Serve (pip install 'ldlm[ray]'; see docs/scale-out.md)")
    ray.add_argument("--ray", action="store_true", help="serve as Ray Serve replicas behind Ray's proxy on --host/--port; each replica is "
                     "one full service (graphs, batching) with the options above")
    ray.add_argument("--ray-address", help="join this Ray cluster ('auto': the one `ray start` made here); default: start a local one")
    ray.add_argument("--replicas", type=_positive_int, help="replicas (default: 1; with --autoscale, the initial count)")
    ray.add_argument("--autoscale", metavar="MIN:MAX", help="let Ray scale the replicas between MIN and MAX with the load")
    ray.add_argument("--replica-cpus", type=float, help="CPUs reserved per replica, fractions allowed (default: 1)")
    ray.add_argument("--replica-gpus", type=float, help="GPUs per replica, fractions allowed: 0.5 puts two on a GPU (default: 0)")
    p.set_defaults(func=_cmd_serve)

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
    p.add_argument("--max-batch", type=_positive_int, default=32, help="max_batch_size (default: 32)")
    p.add_argument("--queue-delay-us", type=int, default=100, help="dynamic batching max_queue_delay_microseconds (default: 100)")
    p.add_argument("--cpu", action="store_true", help="instance groups on CPU (default: GPU)")
    p.add_argument("--cc-plan", action="append", metavar="CC=ENGINE_DIR", help="extra plans per compute capability (cc_model_filenames)")
    p.add_argument("--max-n", type=_positive_int, default=64, help="largest N ldlm_generate accepts (default: 64)")
    p.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=_cmd_triton_repo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, RuntimeError, FileExistsError, FileNotFoundError) as error:
        print(f"ldlm {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
