"""What the KServe v2 endpoints say about the server and its models, as the JSON both transports send: HTTP
as it is, gRPC as the protobuf message parsed from it (``as_message``), so the two never differ.

  server_metadata       name, version, extensions
  model_metadata        a graph's inputs and outputs (symbolic axes -1)
  model_config          Triton's model configuration extension: dims without the batch axis, batching, limits
  statistics            Triton's statistics extension, from the metrics' counters (``Metrics.model_statistics``)
  repository_index      the model repository extension's index (the models are fixed at start: no load or unload)

Every model is one graph of the served artifact, in one version, ``MODEL_VERSION``. Beside them, generation is the
model ``ldlm_generate``; its inputs and outputs (``GENERATE_INPUTS``, ``GENERATE_OUTPUTS``) are defined here once, for
Triton's model of that name (serve/deploy/triton_repo.py writes its config, triton_generate.py reads its inputs) and
for ``ldlm serve``'s over gRPC (grpc_generate), so one client works against both. The dims rule of a model
configuration (``triton_dims``, ``config_type``) is also this module's, for ``ldlm serve``'s answers and Triton's
config.pbtxt alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message

from ldlm import __version__
from ldlm.serve.api.errors import HTTPError
from ldlm.serve.api.kserve import KSERVE_NAMES, load_json, refuse_unknown_fields, tensor_metadata
from ldlm.serve.api.kserve_tensors import ProtocolError

if TYPE_CHECKING:  # for the annotations only: Triton's ldlm_generate imports this module for its inputs and outputs,
    # and the Python embedded in Triton's backend stub cannot load the service's dependencies (prometheus_client's ssl)
    from ldlm.serve.api.service import LDLMService
    from ldlm.serve.runtime.graph_backend import GraphBackend

MODEL_VERSION = "1"
GENERATE_MODEL = "ldlm_generate"  # generation: Triton's Python-backend model, and ldlm serve's (generate_model, grpc_generate)
GENERATE_LABEL = "generate"  # what generations count under in /metrics, whichever route or model brought them
EXTENSIONS = ("binary_tensor_data", "model_configuration", "statistics", "model_repository")
INDEX_FIELDS = ("ready",)

M = TypeVar("M", bound=Message)


@dataclass(frozen=True)
class GenerateTensor:
    """One input or output of ``ldlm_generate``: its KServe datatype and Triton's dims (the model takes one request
    at a time, ``max_batch_size: 0``: no batch axis). An input fills the ``ldlm.sampling.GenerateRequest`` field
    ``field`` ("prompt": the text to continue, as /v1/generate's field of that name) and may be left out unless
    it is required (then ``ldlm.sampling.resolve`` fills it in, as on /v1/generate)."""

    name: str
    datatype: str
    dims: tuple[int, ...] = (1,)
    field: str = ""
    required: bool = False


# Each input is /v1/generate's field of the same name, in upper case, with the same meaning and range.
GENERATE_INPUTS = (
    GenerateTensor("N", "INT64", field="n", required=True),
    GenerateTensor("LENGTH", "INT64", field="length", required=True),  # a prompt's tokens included
    GenerateTensor("STEPS", "INT64", field="steps"),
    GenerateTensor("SEED", "INT64", field="seed"),
    GenerateTensor("SAMPLER", "BYTES", field="sampler"),
    GenerateTensor("T_MIN", "FP32", field="t_min"),
    GenerateTensor("PRIOR_TEMPERATURE", "FP32", field="prior_temperature"),
    GenerateTensor("GRID", "BYTES", field="grid"),
    GenerateTensor("PROMPT", "BYTES", field="prompt"),
    GenerateTensor("PROMPT_STRENGTH", "FP32", field="prompt_strength"),
)
# /v1/generate's answer: texts [N], token_ids [N, LENGTH] (every row LENGTH long) and the plan that ran, as JSON
GENERATE_OUTPUTS = (
    GenerateTensor("TEXTS", "BYTES", (-1,)),
    GenerateTensor("TOKEN_IDS", "INT64", (-1, -1)),
    GenerateTensor("PLAN", "BYTES", (1,)),
)
GENERATE_NAMES = {tensor.field: tensor.name for tensor in GENERATE_INPUTS}  # a field as refusals name it (N=0, T_MIN=1.5)


def served_model(service: LDLMService, model: str, version: str = "") -> GraphBackend | None:
    """The graph ``model`` names, None for ``ldlm_generate`` (the scheduler's generation), or 404 naming the models
    (or the version) there are. "" is the one version."""
    if model not in service.graphs and model != GENERATE_MODEL:
        raise HTTPError(404, f"unknown model {model!r}; available: {', '.join([*service.graphs, GENERATE_MODEL])}")
    if version not in ("", MODEL_VERSION):
        raise HTTPError(404, f"model {model!r} has no version {version!r}; available: {MODEL_VERSION}")
    return service.graphs.get(model)


def metrics_label(service: LDLMService, model: str) -> str | None:
    """What an infer request of ``model`` counts under in /metrics: a served graph's name, the generations' label
    for ldlm_generate; None for any other name, so that no name only a request has becomes a label (the label set,
    and the memory /metrics takes, stay bounded whatever clients send)."""
    return model if model in service.graphs else GENERATE_LABEL if model == GENERATE_MODEL else None


def server_metadata() -> dict[str, Any]:
    return {"name": "ldlm", "version": __version__, "extensions": list(EXTENSIONS)}


def model_metadata(service: LDLMService, model: str, version: str = "") -> dict[str, Any]:
    graph = served_model(service, model, version)
    if graph is None:
        return {
            "name": model,
            "versions": [MODEL_VERSION],
            "platform": "ldlm_generate",
            "inputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.dims)} for t in GENERATE_INPUTS],
            "outputs": [{"name": t.name, "datatype": t.datatype, "shape": list(t.dims)} for t in GENERATE_OUTPUTS],
        }
    return {
        "name": model,
        "versions": [MODEL_VERSION],
        "platform": f"ldlm_{graph.backend}",
        "precision": graph.precision,  # beside KServe's fields: an int8 variant or a cast graph is named as such
        "inputs": tensor_metadata(graph.inputs),
        "outputs": tensor_metadata(graph.outputs),
    }


def model_config(service: LDLMService, model: str, version: str = "") -> dict[str, Any]:
    """The graph as a Triton model configuration says it: ``max_batch_size`` is the most samples one request may
    send (--max-request-samples), the dynamic batcher forms batches of up to ``preferred_batch_size`` (--max-batch,
    or a TensorRT profile's limit), waits up to --max-delay-ms for them and holds up to --max-queue requests."""
    graph = served_model(service, model, version)
    settings = service.settings
    if graph is None:
        return generate_config(settings.max_n, settings.max_steps)
    return {
        "name": model,
        "platform": f"ldlm_{graph.backend}",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": settings.max_request_samples,
        "input": [config_tensor(spec) for spec in graph.inputs],
        "output": [config_tensor(spec) for spec in graph.outputs],
        "dynamic_batching": {
            "preferred_batch_size": [service.max_batch],
            "max_queue_delay_microseconds": round(settings.max_delay_ms * 1000),
            "default_queue_policy": {"max_queue_size": settings.max_queue},
        },
        "instance_group": [{"name": model, "count": 1, "kind": "KIND_CPU" if on_cpu(graph) else "KIND_GPU"}],
        "parameters": {"precision": {"string_value": graph.precision}, "provider": {"string_value": graph.provider}},
    }


def generate_config(max_n: int, max_steps: int) -> dict[str, Any]:
    """ldlm_generate as a Triton model configuration says it: one request at a time (``max_batch_size`` 0, no batch
    axis), its inputs and outputs (an input not required is optional), and the limits it enforces."""
    return {
        "name": GENERATE_MODEL,
        "platform": "ldlm_generate",
        "max_batch_size": 0,
        "input": [
            {"name": t.name, "data_type": config_type(t.datatype), "dims": list(t.dims), **({} if t.required else {"optional": True})}
            for t in GENERATE_INPUTS
        ],
        "output": [{"name": t.name, "data_type": config_type(t.datatype), "dims": list(t.dims)} for t in GENERATE_OUTPUTS],
        "parameters": {"max_n": {"string_value": str(max_n)}, "max_steps": {"string_value": str(max_steps)}},
    }


def config_tensor(spec: dict[str, Any]) -> dict[str, Any]:
    """One input or output as Triton's config lists it (``triton_dims``); a per-sample scalar (shape [batch]) is
    dims [1] reshaped to [] for the graph."""
    entry: dict[str, Any] = {"name": spec["name"], "data_type": config_type(KSERVE_NAMES[spec["dtype"]]), "dims": triton_dims(spec)}
    if len(spec["shape"]) == 1:
        entry["reshape"] = {"shape": []}
    return entry


def triton_dims(spec: dict[str, Any]) -> list[int]:
    """A graph's input or output (a manifest spec) as Triton's dims: without the batch axis, symbolic axes -1,
    and a bare [batch] (a per-sample scalar) as [1]."""
    return [d if isinstance(d, int) else -1 for d in spec["shape"][1:]] or [1]


def config_type(datatype: str) -> str:
    """A KServe datatype as a model configuration's ``data_type`` names it (BYTES is TYPE_STRING there)."""
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


def on_cpu(graph: GraphBackend) -> bool:
    """Whether the graph runs on the host: ONNX Runtime's CPU provider, or a torch graph on the cpu device."""
    return graph.provider == "CPUExecutionProvider" or str(getattr(graph, "device", "")).startswith("cpu")


def statistics(service: LDLMService, model: str = "", version: str = "") -> dict[str, Any]:
    """Triton's statistics of ``model``, or of every model when it is ""."""
    models = [model] if model else [*service.graphs, GENERATE_MODEL]
    for name in models:
        served_model(service, name, version)
    return {"model_stats": [model_statistics(service, name) for name in models]}


def model_statistics(service: LDLMService, model: str) -> dict[str, Any]:
    """One model's statistics. ldlm_generate's requests are its infer and stream requests; its executions are the
    scheduler's denoising steps (their batch sizes, queue and compute times), which every generation shares,
    whichever route sent it."""
    if model != GENERATE_MODEL:
        return service.metrics.model_statistics(model, MODEL_VERSION)
    return {**service.metrics.model_statistics(GENERATE_LABEL, MODEL_VERSION), "name": GENERATE_MODEL}


def repository_index(service: LDLMService, ready_only: bool = False) -> list[dict[str, str]]:
    """Every served model and its state; ``ready_only``: none while the server is not ready."""
    state = "READY" if service.ready else "UNAVAILABLE"
    return [
        {"name": name, "version": MODEL_VERSION, "state": state, "reason": ""}
        for name in [*service.graphs, GENERATE_MODEL]
        if service.ready or not ready_only
    ]


def index_request(body: bytes) -> bool:
    """The ``ready`` flag of a repository index request's body: none, or ``{"ready": true|false}``."""
    if not body.strip():
        return False
    payload = load_json(body)
    if not isinstance(payload, dict):
        raise ProtocolError('the repository index request must be a JSON object, such as {"ready": true}, or empty')
    refuse_unknown_fields(payload, INDEX_FIELDS, "the repository index request")
    ready = payload.get("ready", False)
    if not isinstance(ready, bool):
        raise ProtocolError(f"field 'ready' is {ready!r}; allowed: true or false")
    return ready


def as_message(payload: dict[str, Any], message: M) -> M:
    """``payload`` parsed into the protobuf ``message`` (gRPC's form of the same answer); fields the message
    lacks (metadata's ``precision``) are left out."""
    return json_format.ParseDict(payload, message, ignore_unknown_fields=True)
