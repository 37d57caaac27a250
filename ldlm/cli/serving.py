"""The HTTP service: `ldlm serve`, locally or as Ray Serve replicas."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path

from ldlm.cli.options import capped_positive_int, device_options, float_in, in_range
from ldlm.limits import MAX_DELAY_MS, MAX_THREADS, PREVIEW_BUDGET, PREVIEW_LONE_BUDGET, SETTINGS, TIMEOUT_S
from ldlm.serve.runtime.registry import backend_help, backend_names, default_backend

MAX_REPLICAS = 4096  # RayOptions' limit
MAX_REPLICA_CPUS = 1024.0
MAX_REPLICA_GPUS = 64.0
SECONDS = in_range(TIMEOUT_S, " s")


def setting(name: str, why: str = "") -> Callable[[str], float] | Callable[[str], int]:
    """The argparse type of a ServerSettings field: its range is the server's own (``ldlm.limits.SETTINGS``)."""
    return in_range(SETTINGS[name], why)


def api_key(option: str | None, environ: Mapping[str, str]) -> str | None:
    """The key --api-key or LDLM_API_KEY gives, or None for no auth. An empty one is refused: taken as
    "no key" it would start the server with auth off, which its user asked not to."""
    allowed = "allowed: a key of at least one non-space character. To serve without a key"
    if option is not None:
        if not option.strip():
            raise ValueError(f"--api-key {option!r} is empty; {allowed}, leave --api-key out (and LDLM_API_KEY unset)")
        return option
    key = environ.get("LDLM_API_KEY")
    if key is not None and not key.strip():
        raise ValueError(f"LDLM_API_KEY={key!r} is empty; {allowed}, unset it (unset LDLM_API_KEY)")
    return key


def otlp_endpoint(url: str) -> str:
    """The argparse type of --otlp-traces-endpoint: a collector's URL (``tracing.check_endpoint``), else the error naming it."""
    from ldlm.serve.runtime.tracing import check_endpoint  # per use: building the parser imports no OpenTelemetry

    try:
        return check_endpoint(url)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def compile_cache(environ: MutableMapping[str, str], root: Path) -> None:
    """Keep torch.compile's caches (Inductor's FX graph and AOTAutograd caches, Triton's kernels) under the
    service's own cache, ``root``/torch-compile, unless $TORCHINDUCTOR_CACHE_DIR says where: torch's default is
    /tmp/torchinductor_$USER, which a reboot or a fresh container empties, so every start would compile again."""
    environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "torch-compile"))


def refuse_ray_only(args: argparse.Namespace) -> None:
    """The Ray Serve options given without --ray, as an error naming them."""
    ray_only = {
        "--ray-address": args.ray_address,
        "--replicas": args.replicas,
        "--autoscale": args.autoscale,
        "--replica-cpus": args.replica_cpus,
        "--replica-gpus": args.replica_gpus,
    }
    if any(value is not None for value in ray_only.values()):
        given = [flag for flag, value in ray_only.items() if value is not None]
        raise ValueError(
            f"{', '.join(given)} only appl{'ies' if len(given) == 1 else 'y'} with --ray; add --ray, or leave "
            f"{'it' if len(given) == 1 else 'them'} out"
        )


def _cmd_serve(args: argparse.Namespace) -> None:
    key = api_key(args.api_key, os.environ)  # before anything loads
    # per command, not at the top: building the parser (`ldlm --help`) imports no torch
    from ldlm.serve.api.export_cache import cache_root
    from ldlm.serve.api.server import serve
    from ldlm.serve.api.service import ServerSettings

    compile_cache(os.environ, cache_root())  # before the first compile reads it
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        backend=args.backend or "",  # none named: the service's default for --device
        max_batch=args.max_batch,
        max_delay_ms=args.max_delay_ms,
        max_queue=args.max_queue,
        request_timeout_s=args.timeout_s,
        max_body_bytes=args.max_body_mb << 20,
        api_key=key,
        threads=args.threads,
        device=args.device,
        precision=args.precision or "",  # none named: the default for the backend on --device
        provider=args.provider,
        max_request_samples=args.max_request_samples,
        max_request_tokens=args.max_request_tokens,
        header_timeout_s=args.header_timeout_s,
        export_cache=None if args.no_export_cache else str(cache_root()),
        body_timeout_s=args.body_timeout_s,
        max_connections=args.max_connections,
        preview_budget=args.preview_budget,
        preview_lone_budget=args.preview_lone_budget,
        trt_cuda_graphs=args.trt_cuda_graphs,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )
    if args.ray:
        if args.grpc_port is not None:
            raise ValueError(f"--grpc-port {args.grpc_port} applies without --ray only: Ray's proxy serves HTTP; leave it out")
        try:
            from ldlm.serve.deploy.ray_app import RayOptions, parse_autoscale, run_on_ray  # optional: Ray
        except ImportError as error:
            raise RuntimeError(f"--ray needs Ray Serve: pip install 'ldlm[ray]' ({error})") from None
        low, high = parse_autoscale(args.autoscale) if args.autoscale else (None, None)
        options = RayOptions(
            replicas=args.replicas or max(low or 1, 1),
            min_replicas=low,
            max_replicas=high,
            num_cpus=1.0 if args.replica_cpus is None else args.replica_cpus,
            num_gpus=args.replica_gpus or 0.0,
        )
        run_on_ray(args.source, settings, options, args.ray_address)
        return
    refuse_ray_only(args)
    serve(args.source, dataclasses.replace(settings, grpc_port=grpc_port(args)), args.log_level)


def grpc_port(args: argparse.Namespace) -> int | None:
    """Where KServe v2 over gRPC is served beside HTTP (None: nowhere): --grpc-port, or by default --port + 1,
    unless --no-grpc. The port is checked here, before anything loads: one named by --grpc-port that another
    server holds is an error; the default one, taken, is said on stderr and the server goes on over HTTP alone."""
    # per command: building the parser imports no grpc
    from ldlm.serve.api.grpc_server import GrpcPortInUseError, check_grpc_port, default_grpc_port

    if args.no_grpc and args.grpc_port is not None:
        raise ValueError(f"--grpc-port {args.grpc_port} and --no-grpc contradict each other; leave one of them out")
    port = None if args.no_grpc else default_grpc_port(args.port) if args.grpc_port is None else args.grpc_port
    try:
        if port is not None:
            check_grpc_port(args.host, port)
    except GrpcPortInUseError as error:
        if args.grpc_port is not None:
            raise
        print(f"ldlm serve: warning: {error}; going on without a gRPC endpoint", file=sys.stderr, flush=True)
        port = None
    return port


def preview_options(p: argparse.ArgumentParser) -> None:
    """The shares of wall time that streamed previews may take (serve/runtime/delivery.py)."""
    p.add_argument(
        "--preview-budget",
        type=setting("preview_budget"),
        default=PREVIEW_BUDGET,
        help="share of wall time that decoding streamed denoising previews may take while other generations are in "
        f"flight; previews are skipped, never queued, beyond it (default: {PREVIEW_BUDGET:g})",
    )
    p.add_argument(
        "--preview-lone-budget",
        type=setting("preview_lone_budget"),
        default=PREVIEW_LONE_BUDGET,
        help="the same while a stream's generation is the only one; 1 sends every preview asked for, in step order "
        f"(default: {PREVIEW_LONE_BUDGET:g})",
    )


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve the graphs over HTTP and gRPC (KServe v2) and a text API",
        description="Serve KServe v2 over HTTP and gRPC (health, metadata, config, statistics, infer with JSON and binary "
        "tensors, so tritonclient's HTTP and gRPC clients work) for "
        "the encoder, denoiser and decoder graphs, plus POST /v1/generate, /v1/reconstruct and /v1/encode, with "
        "dynamic batching, continuous batching for generation, Prometheus /metrics and OpenAPI /docs. Binds "
        "127.0.0.1 unless told otherwise. SIGINT/SIGTERM finish in-flight requests before exiting.",
    )
    p.add_argument(
        "source",
        help="checkpoint (eager, compiled, inductor; ort exports it first), `ldlm export` dir (ort) or `ldlm build-engine` dir (trt)",
    )
    p.add_argument(
        "--backend",
        choices=backend_names(),
        help=f"{backend_help()}. The torch backends run on --device; inductor compiles each bucket on its first call "
        f"(seconds to a minute; kept in $TORCHINDUCTOR_CACHE_DIR, by default under the cache below, for the next start) "
        f"(default: {default_backend('cuda')} with --device cuda, else {default_backend()})",
    )
    p.add_argument(
        "--no-export-cache",
        action="store_true",
        help="ort serving a checkpoint: export it into a scratch directory, not the cache of verified exports reused at the "
        "next start ($LDLM_CACHE_DIR, else $XDG_CACHE_HOME/ldlm, else ~/.cache/ldlm; under exports/)",
    )
    device_options(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=setting("port"), default=8000, help="0..65535; 0 lets the OS pick one (default: 8000)")
    p.add_argument(
        "--grpc-port",
        type=setting("port"),
        help="KServe v2 over gRPC (tritonclient.grpc) on this port of --host, beside HTTP; 0 lets the OS pick one "
        "(default: --port + 1, so 8001 beside 8000, as Triton; when that one is taken, HTTP alone, with a warning)",
    )
    p.add_argument("--no-grpc", action="store_true", help="serve HTTP alone, no gRPC endpoint")
    p.add_argument(
        "--max-batch",
        type=setting("max_batch", " samples per execution (as ldlm serve's max_batch)"),
        default=16,
        help="samples per execution (default: 16)",
    )
    p.add_argument(
        "--max-delay-ms",
        type=setting("max_delay_ms", " ms"),
        default=0.0,
        help=f"dynamic batching window, 0..{MAX_DELAY_MS:g}; 0 batches whatever queued during the last run (default: 0)",
    )
    preview_options(p)
    p.add_argument(
        "--trt-cuda-graphs",
        action="store_true",
        help="trt: replay CUDA graphs (TensorRT-RTX captures its own; "
        "NVIDIA TensorRT: one capture per profile and shape). The compiled backend uses CUDA graphs on cuda anyway",
    )
    _serve_limit_options(p)
    _serve_ray_options(p)
    p.set_defaults(func=_cmd_serve)


def _serve_limit_options(p: argparse.ArgumentParser) -> None:
    """What one request may ask and how long it may take: the limits of ServerSettings."""
    p.add_argument("--max-queue", type=setting("max_queue"), default=256, help="waiting requests per graph before 503 (default: 256)")
    p.add_argument("--timeout-s", type=SECONDS, default=60.0, help="per-request timeout, then 504 (default: 60)")
    p.add_argument(
        "--max-body-mb",
        type=capped_positive_int(int(SETTINGS["max_body_bytes"].high) >> 20, " MiB"),
        default=8,
        help="request body cap, then 413 (default: 8 MiB)",
    )
    p.add_argument(
        "--max-request-samples",
        type=setting("max_request_samples"),
        default=64,
        help="batch size of one /v2 infer request, then 413 (default: 64)",
    )
    p.add_argument(
        "--max-request-tokens",
        type=setting("max_request_tokens"),
        default=8192,
        help="batch x seq of one /v2 infer request, then 413 (default: 8192)",
    )
    p.add_argument("--header-timeout-s", type=SECONDS, default=10.0, help="a request's headers must arrive within this (default: 10)")
    p.add_argument("--body-timeout-s", type=SECONDS, default=30.0, help="a request's body must arrive within this, then 408 (default: 30)")
    p.add_argument(
        "--max-connections",
        type=setting("max_connections"),
        default=1024,
        help="open connections; above it the oldest idle one is closed, and if all are busy a new one gets 503 (default: 1024)",
    )
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY'. Prefer the LDLM_API_KEY environment variable: "
        "a command-line key is visible to every user in the process list. Off by default",
    )
    p.add_argument(
        "--threads",
        type=setting("threads", " threads"),
        help=f"ONNX Runtime intra-op threads, 1..{MAX_THREADS} (default: its own)",
    )
    p.add_argument(
        "--otlp-traces-endpoint",
        type=otlp_endpoint,
        metavar="URL",
        help="send OpenTelemetry traces of every request over OTLP/gRPC to this collector (Jaeger, Tempo, the OpenTelemetry "
        "Collector), e.g. http://localhost:4317; a caller's W3C traceparent header is each request's parent. Needs "
        "pip install 'ldlm[otel]'. Default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else $OTEL_EXPORTER_OTLP_ENDPOINT, else off "
        "(docs/serving.md, Tracing)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="level of the JSON request log on stderr; info logs one line per request (default: info)",
    )


def _serve_ray_options(p: argparse.ArgumentParser) -> None:
    ray = p.add_argument_group("Ray Serve (pip install 'ldlm[ray]'; see docs/scale-out.md)")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="serve as Ray Serve replicas behind Ray's proxy on --host/--port; each replica is "
        "one full service (graphs, batching) with the options above",
    )
    ray.add_argument("--ray-address", help="join this Ray cluster ('auto': the one `ray start` made here); default: start a local one")
    ray.add_argument(
        "--replicas", type=capped_positive_int(MAX_REPLICAS, " replicas"), help="replicas (default: 1; with --autoscale, the initial count)"
    )
    ray.add_argument("--autoscale", metavar="MIN:MAX", help="let Ray scale the replicas between MIN and MAX with the load")
    ray.add_argument(
        "--replica-cpus",
        type=float_in(0, MAX_REPLICA_CPUS, " CPUs per replica"),
        help="CPUs reserved per replica, fractions allowed (default: 1)",
    )
    ray.add_argument(
        "--replica-gpus",
        type=float_in(0, MAX_REPLICA_GPUS, " GPUs per replica"),
        help="GPUs per replica, fractions allowed: 0.5 puts two on a GPU (default: 0)",
    )
