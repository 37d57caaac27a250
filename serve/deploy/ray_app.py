"""The service as a Ray Serve application: the same FastAPI app (KServe v2, /v1/*, /metrics, /docs),
run by N replicas behind Ray's HTTP proxy.

Each replica is one Ray actor that builds its own ``LDLMService`` (graphs, dynamic batchers, the
continuous-batching scheduler) and serves ``create_app(service)`` through ``@serve.ingress``. The
app is built by a builder function that Ray calls inside the replica at start-up, so the graphs are
loaded there and never pickled; the app's lifespan drains the replica's queues when Ray stops it.

    ldlm serve runs/onnx --ray --replicas 2 --threads 1          # local Ray, or --ray-address auto
    serve run ldlm.serve.deploy.ray_app:app_builder source=runs/onnx replicas=2 threads=1

``serve run`` (and a ``serveConfigV2`` on KubeRay) passes ``key=value`` arguments to
``app_builder``: ``source``, any ``ServerSettings`` field (backend, threads, max_batch, ...) and any
``RayOptions`` field (replicas, min_replicas, max_replicas, num_cpus, num_gpus, ...).
See docs/scale-out.md.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import typing
from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve import Application

from ldlm.serve.api.server import create_app
from ldlm.serve.api.service import LDLMService, ServerSettings

DEPLOYMENT_NAME = "ldlm"
APP_NAME = "ldlm"
BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False}
# Ray Serve gives a starting HTTP proxy 5 s to answer its ready check, then kills it (ActorDiedError:
# "killed by ray.kill", "never ran"). A fresh proxy process imports Serve, uvicorn and FastAPI first,
# which took longer than that on two busy cores. Processes of a cluster that ray.init starts inherit
# these; a cluster joined by address keeps its own settings.
PATIENT_PROXY_ENV = {"RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": "60", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S": "30"}


def patient_proxy() -> None:
    """Give Ray Serve's proxy time to start on a loaded machine (PATIENT_PROXY_ENV), unless the
    environment already says otherwise. Call before ``ray.init``."""
    for name, value in PATIENT_PROXY_ENV.items():
        os.environ.setdefault(name, value)


@dataclass(frozen=True)
class RayOptions:
    """How Ray runs the replicas. ``min_replicas``/``max_replicas`` turn on autoscaling (then
    ``replicas`` is the initial count); ``num_cpus``/``num_gpus`` are per replica and may be
    fractions (0.5 GPU: two replicas share one GPU)."""

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 8.0  # autoscaling aims at this many requests in flight per replica
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    # Ray's default (5) would starve continuous batching: let a replica hold a full batch and more.
    max_ongoing_requests: int = 64
    # Requests waiting in Ray's routers beyond the replicas' slots; past this Ray answers 503.
    max_queued_requests: int = 1024

    def __post_init__(self) -> None:
        checks = {
            "replicas": (self.replicas, 1, 4096),
            "max_ongoing_requests": (self.max_ongoing_requests, 1, 1 << 16),
            "max_queued_requests": (self.max_queued_requests, 1, 1 << 20),
        }
        for name, (value, low, high) in checks.items():
            if not low <= value <= high:
                raise ValueError(f"{name}={value} is out of range; allowed: {low}..{high}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("min_replicas and max_replicas go together (autoscaling); give both or neither")
        if (
            self.min_replicas is not None
            and self.max_replicas is not None
            and (not 0 <= self.min_replicas <= self.replicas <= self.max_replicas or self.max_replicas < 1)
        ):
            raise ValueError(
                f"autoscaling needs 0 <= min_replicas ({self.min_replicas}) <= replicas ({self.replicas}) "
                f"<= max_replicas ({self.max_replicas}) and max_replicas >= 1"
            )
        if self.target_ongoing_requests <= 0:
            raise ValueError(f"target_ongoing_requests={self.target_ongoing_requests} is out of range; allowed: > 0")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError(f"num_cpus={self.num_cpus} and num_gpus={self.num_gpus} must be >= 0 (fractions allowed)")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments of ``serve.deployment`` / ``Deployment.options``."""
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
        }
        if self.autoscaling:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas,
                "max_replicas": self.max_replicas,
                "initial_replicas": self.replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
            }
        else:
            options["num_replicas"] = self.replicas
        return options


def build_app(source: str, settings: ServerSettings, options: RayOptions = RayOptions()) -> Application:
    """The Ray Serve application: one deployment whose replicas each serve ``create_app`` over
    their own ``LDLMService(source, settings)``. ``source`` must be readable on every node."""

    def build_asgi_app() -> Any:  # runs inside each replica, after Ray placed it (and its GPU)
        app = create_app(LDLMService(source, settings))
        app.add_middleware(OneRequestIdHeader)
        return app

    @serve.ingress(build_asgi_app)
    class LDLMReplica:
        """One replica: the graphs, the batchers and the scheduler of one ``ldlm serve`` process."""

    deployment = serve.deployment(LDLMReplica, name=DEPLOYMENT_NAME, **options.deployment_options())
    return deployment.bind()  # type: ignore[attr-defined, unused-ignore]  # Ray's overloads lose the Deployment type of a class


class OneRequestIdHeader:
    """Ray's proxy puts its request id into the request's X-Request-ID (keeping the client's) and
    adds the header to the response; the replica's app adds the same id too. Drop the replica's
    copy so clients see the header once, as from ``ldlm serve``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        async def send_once(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
            await send(message)

        await self.app(scope, receive, send_once if scope["type"] == "http" else send)


def app_builder(args: dict[str, Any]) -> Application:
    """Entry point for ``serve run ldlm.serve.deploy.ray_app:app_builder source=DIR key=value ...`` and for
    a Serve config file's ``import_path``. Values may arrive as strings; each is converted to the
    type of the field it names."""
    args = dict(args)
    if "source" not in args:
        raise ValueError("app_builder needs source=<checkpoint, `ldlm export` or `ldlm build-engine` directory>")
    source = str(args.pop("source"))
    settings_args = _typed(ServerSettings, {k: v for k, v in args.items() if k in _field_names(ServerSettings)})
    options_args = _typed(RayOptions, {k: v for k, v in args.items() if k in _field_names(RayOptions)})
    unknown = sorted(set(args) - _field_names(ServerSettings) - _field_names(RayOptions))
    if unknown:
        allowed = ", ".join(["source", *sorted(_field_names(ServerSettings) | _field_names(RayOptions))])
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}; allowed: {allowed}")
    return build_app(source, ServerSettings(**settings_args), RayOptions(**options_args))


def parse_autoscale(text: str) -> tuple[int, int]:
    """``MIN:MAX`` (``ldlm serve --ray --autoscale 1:4``) -> (1, 4)."""
    low, _, high = text.partition(":")
    if not (low.strip().isdigit() and high.strip().isdigit()):
        raise ValueError(f"autoscale {text!r} is not MIN:MAX replicas (e.g. 1:4)")
    return int(low), int(high)


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _typed(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """Convert ``key=value`` strings to the type each field declares (int, float, bool, str; ``X | None``
    as X). Bools take true/false/1/0: ``bool("false")`` would be True."""
    hints = typing.get_type_hints(cls)
    typed: dict[str, Any] = {}
    for name, value in values.items():
        kinds = [k for k in typing.get_args(hints[name]) if k is not type(None)] or [hints[name]]
        kind = kinds[0]
        if isinstance(value, str) and kind is not str:
            typed[name] = _parse(name, value, kind)
        else:
            typed[name] = value
    return typed


def _parse(name: str, value: str, kind: type) -> Any:
    if kind is bool:
        word = value.strip().lower()
        if word not in BOOL_WORDS:
            raise ValueError(f"{name}={value!r} is not a valid bool; allowed: {', '.join(BOOL_WORDS)}")
        return BOOL_WORDS[word]
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not a valid {kind.__name__}") from None


def run_on_ray(source: str, settings: ServerSettings, options: RayOptions, address: str | None = None) -> None:
    """``ldlm serve --ray``: join (``address``, e.g. "auto") or start a Ray cluster, deploy, print
    where it listens, serve until SIGINT/SIGTERM, then take the application down (replicas drain;
    Serve and Ray too if this call started them)."""
    import ray  # optional (the [ray] extra): only `ldlm serve --ray` needs it

    patient_proxy()
    ray.init(address=address, include_dashboard=False, log_to_driver=False)
    # After ray.init: Ray's core worker installs a SIGTERM handler that aborts the process, so ours
    # must come later, and before the deploy, so that a signal during start-up still ends cleanly.
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": settings.host, "port": settings.port})
        serve.run(build_app(source, settings, options), name=APP_NAME, route_prefix="/")
        url = f"http://{settings.host}:{settings.port}"
        scale = f"autoscaling {options.min_replicas}..{options.max_replicas}" if options.autoscaling else f"{options.replicas} replica(s)"
        print(
            f"ldlm serving {source} on Ray Serve ({settings.backend}; {scale}, {options.num_cpus:g} CPU and "
            f"{options.num_gpus:g} GPU each) on {url}",
            flush=True,
        )
        print(f"docs: {url}/docs   replicas: `serve status` (with RAY_ADDRESS set) or the Ray dashboard", flush=True)
        while not stop.wait(0.5):
            pass
        print("stopping: replicas finish what they hold", flush=True)
        if address is None:
            serve.shutdown()  # our own cluster: all of Serve goes
        else:
            serve.delete(APP_NAME)  # a shared cluster: only our application
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        ray.shutdown()
