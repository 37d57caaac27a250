"""The soak's traffic, as a Locust file (run headless by scripts/research/soak.py; not on its own).

HTTP requests are sent with httpx (or the official ``openai`` client) to 127.0.0.1, gRPC calls (KServe v2:
ModelInfer on the encoder, ModelStreamInfer on ``ldlm_generate``, hostile messages of both) with grpc's own
stubs to ``$SOAK_GRPC``; each is classified by what came back, never by what was hoped for:

  answered        2xx (gRPC: OK) and a body that parses (JSON, KServe binary, Server-Sent Events ending in a
                  result; a gRPC answer's raw outputs of their shapes, a stream's result with TEXTS, TOKEN_IDS, PLAN)
  refused:<code>  4xx/5xx with the one error shape (503 must carry Retry-After, else it is ``503 without Retry-After``);
                  a gRPC error under the HTTP status its code stands for (the inverse of GRPC_CODES), a code
                  that stands for none as ``refused:grpc-<CODE>``; a stream's in-band error_message by its words
  left              the client itself gave up mid-request (10% of generations, completions and gRPC streams do, on purpose)
  server down       no connection while the soak was stopping or had stopped the server (a marker file says so),
                  or a gRPC call the stopping server refused to start (its GOAWAY: HTTP/2's "not processed")
  killed in flight  connected, then cut off by the soak's SIGKILL (expected of a killed process)
  no connection     no connection while the server was up
  no answer         connected and sent, then no status: a lost request (a SIGTERM must never cause one)
  unparseable       a status with a body that does not parse
  (replica killed)  a 5xx while the soak had killed one of Ray's replicas, counted apart

Each call is recorded under the model label the server's request counters count it with, or as not counted
(a gRPC call to an unknown model, a message grpc itself refused as too large, a call that never reached the
server). Each Locust process writes its counts and per-minute latencies to ``$SOAK_OUT/traffic-<pid>.json``
when it quits.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import gevent
import grpc
import grpc.experimental.gevent
import httpx
import numpy as np
from locust import User, between, events, task
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import deserialize_bytes_tensor

from ldlm.export.graphs import GRAPH_NAMES
from ldlm.serve.api.grpc_kserve import GRPC_CODES
from ldlm.serve.api.kserve_models import GENERATE_LABEL
from ldlm.serve.api.service import ServerSettings

# Locust runs every user on gevent (it patched the standard library on import): grpc's own waits must yield to
# it before any channel exists, or one call blocks every user of the process
grpc.experimental.gevent.init_gevent()

OUT = Path(os.environ.get("SOAK_OUT", "."))
DOWN = OUT / "server-down"  # present while the soak stops the server on purpose; it holds the signal's name
D_MODEL = int(os.environ.get("SOAK_D_MODEL", "64"))
LEAVE_SHARE = 0.1
BURST = int(os.environ.get("SOAK_BURST", "160"))  # above the server's generation queue: some must be refused 503
PROMPT = "Mr. Darcy looked at Elizabeth and"
GRPC = os.environ.get("SOAK_GRPC", "")  # host:port of the server's gRPC endpoint ("": none, as under --ray)
# The HTTP status each gRPC code stands for; DEADLINE_EXCEEDED stands for 408 and 504 alike, and reads as 504
HTTP_STATUS = {code: status for status, code in sorted(GRPC_CODES.items())}

outcomes: Counter[tuple[str, str]] = Counter()
latencies: dict[tuple[str, int], list[float]] = defaultdict(list)  # (route, minute) -> ms of answered requests
sent_after: list[tuple[float, str | None, str]] = []  # (start wall time, model label as the server counts it, outcome)
started = time.time()


def model_of(path: str) -> str | None:
    """The label the server's request counters use for ``path`` (http_guard's ``GuardMiddleware.model_label``): a
    served graph's name for its /v2 infer, a /v1 route's name (every /v1 path sent here is a route); None (not
    counted) for an unknown model."""
    parts = path.split("/")
    if path.startswith("/v2/models/"):
        return parts[3] if parts[3] in GRAPH_NAMES else None
    return parts[2]


def record(route: str, outcome: str, ms: float, label: str | None, start: float) -> None:
    """One request's outcome on ``route``; ``label``: the model label the server counts it with (None: the
    server does not count it)."""
    outcomes[(route, outcome)] += 1
    sent_after.append((start, label, outcome))
    if outcome == "answered":
        latencies[(route, int((time.time() - started) // 60))].append(ms)


def parses(response: httpx.Response) -> bool:
    kind = response.headers.get("content-type", "")
    try:
        if "event-stream" in kind:
            events_ = [e for e in response.text.split("\n\n") if e.strip()]
            return all(
                json.loads(line[6:]) is not None
                for e in events_
                for line in e.splitlines()
                if line.startswith("data: ") and line != "data: [DONE]"
            )
        if "Inference-Header-Content-Length" in response.headers:
            return json.loads(response.content[: int(response.headers["Inference-Header-Content-Length"])]) is not None
        return json.loads(response.content) is not None
    except (ValueError, KeyError):
        return False


def classify(response: httpx.Response) -> str:
    if not parses(response):
        return "unparseable"
    if response.status_code >= 500 and DOWN.exists() and DOWN.read_text() == "REPLICA":
        return f"refused:{response.status_code} (replica killed)"
    if response.status_code < 300:
        return "answered"
    if response.status_code == 503 and "retry-after" not in response.headers:
        return "503 without Retry-After"
    return f"refused:{response.status_code}"


def send(client: httpx.Client, route: str, path: str, leave: bool = False, **kwargs: Any) -> None:
    """One request, classified; ``leave``: the client closes the connection before the answer is read."""
    start, clock = time.time(), time.perf_counter()
    try:
        response = leave_early(client, path, **kwargs) if leave else client.post(path, timeout=120, **kwargs)
        outcome = "left" if response is None else classify(response)
    except httpx.TransportError as error:
        outcome = lost(error)
    record(route, outcome, 1000 * (time.perf_counter() - clock), model_of(path), start)


def lost(error: BaseException) -> str:
    """What a request without a status was: never connected, or connected and then left without an answer."""
    stopping = DOWN.read_text() if DOWN.exists() else ""
    if type(error).__name__ == "ConnectError":  # httpx's, or that of the openai client's own copy of httpx
        return "server down" if stopping else "no connection"
    return "killed in flight" if stopping == "SIGKILL" else f"no answer ({type(error).__name__})"


def leave_early(client: httpx.Client, path: str, **kwargs: Any) -> httpx.Response | None:
    """The request sent, then the connection closed if nothing came back within 50 ms (None: the client left);
    an answer that beat it is returned whole."""
    try:  # the read timeout covers the status line too: a client that leaves before it is the common case
        with client.stream("POST", path, timeout=httpx.Timeout(30, read=0.05), **kwargs) as response:
            response.read()
            return response
    except httpx.ReadTimeout:
        return None


def encoder_json(seq: int = 16) -> dict[str, Any]:
    ids = np.random.default_rng().integers(0, 50000, (1, seq)).tolist()
    return {
        "inputs": [
            {"name": "input_ids", "shape": [1, seq], "datatype": "INT64", "data": ids},
            {"name": "attention_mask", "shape": [1, seq], "datatype": "INT64", "data": [[1] * seq]},
        ]
    }


def encoder_binary(seq: int = 16) -> tuple[bytes, dict[str, str]]:
    ids = np.ones((1, seq), dtype=np.int64)
    inputs = [
        {"name": n, "shape": [1, seq], "datatype": "INT64", "parameters": {"binary_data_size": ids.nbytes}}
        for n in ("input_ids", "attention_mask")
    ]
    head = json.dumps({"inputs": inputs, "outputs": [{"name": "latents", "parameters": {"binary_data": True}}]}).encode()
    return head + ids.tobytes() * 2, {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}


def latents_json(graph: str, seq: int = 8) -> dict[str, Any]:
    x = np.random.default_rng().standard_normal((1, seq, D_MODEL)).round(4).tolist()
    mask = {"name": "attention_mask", "shape": [1, seq], "datatype": "INT64", "data": [[1] * seq]}
    if graph == "decoder":
        return {"inputs": [{"name": "latents", "shape": [1, seq, D_MODEL], "datatype": "FP32", "data": x}, mask]}
    latent = {"shape": [1, seq, D_MODEL], "datatype": "FP32", "data": x}
    t = {"name": "t", "shape": [1], "datatype": "FP32", "data": [0.5]}
    return {"inputs": [{"name": "x_t", **latent}, t, {"name": "x0_prev", **latent}, mask]}


HOSTILE: list[tuple[str, bytes]] = [  # each must be refused with a status and the error shape
    ("/v1/generate", b"{"),
    ("/v1/generate", json.dumps({"n": 10**9}).encode()),
    ("/v1/generate", json.dumps({"lenght": 8}).encode()),
    ("/v1/generate", json.dumps({"steps": True}).encode()),
    ("/v1/completions", json.dumps({"model": "ldlm", "prompt": "x", "best_of": 3}).encode()),
    (
        "/v2/models/encoder/infer",
        json.dumps({"inputs": [{"name": "input_ids", "shape": [1, 2], "datatype": "INT64", "data": [1]}]}).encode(),
    ),
    ("/v2/models/nope/infer", b"{}"),
]


class GrpcClient:
    """A user's channel to the server's gRPC endpoint. After a call that never reached the server the channel is
    replaced: a failed channel waits out grpc's reconnect backoff, and its calls would fail on their own for that
    long after the server is back."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.open()

    def open(self) -> None:
        self.channel = grpc.insecure_channel(self.target)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    def reopen(self) -> None:
        self.channel.close()
        self.open()


def rpc_outcome(error: grpc.RpcError) -> tuple[str, bool]:
    """What a failed gRPC call was, and whether the server's handler answered it: its refusals carry the
    ``x-request-id`` trailer; grpc's own (a message above the size cap, a lost connection) carry none."""
    code, details = error.code(), error.details() or ""
    trailers = dict(error.trailing_metadata() or ())
    handled = "x-request-id" in trailers
    if not handled and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return grpc_lost(code, details), False  # the transport's words, or our own deadline: no status from the server
    if code not in HTTP_STATUS:
        return f"refused:grpc-{code.name}", handled
    if HTTP_STATUS[code] == 503 and "retry-after" not in trailers:
        return "503 without Retry-After", handled
    return f"refused:{HTTP_STATUS[code]}", handled


def grpc_lost(code: grpc.StatusCode, details: str) -> str:
    """A gRPC call without a status from the server, as ``lost`` reads an HTTP request without one."""
    stopping = DOWN.read_text() if DOWN.exists() else ""
    if "failed to connect" in details.lower():  # grpc's words for a channel that never connected
        return "server down" if stopping else "no connection"
    # A server stopping gracefully sends GOAWAY: calls it had started finish, one sent after is refused unstarted
    # (its handler never saw it: no request id, and the server's counters, checked against these, have no count of it)
    if stopping == "SIGTERM" and "goaway received" in details.lower():
        return "server down"
    return "killed in flight" if stopping == "SIGKILL" else f"no answer (grpc {code.name}: {details[:60]})"


BYTES_PER = {"FP32": 4, "INT64": 8}  # of the datatypes the graphs answer with


def infer_parses(response: Any) -> bool:
    """Every output named, with raw contents of exactly its shape's size."""
    raw = response.raw_output_contents
    return (
        len(response.outputs) > 0
        and len(raw) == len(response.outputs)
        and all(len(r) == BYTES_PER.get(o.datatype, -1) * int(np.prod(o.shape)) for o, r in zip(response.outputs, raw))
    )


def result_parses(response: Any, n: int) -> bool:
    """A stream's result: TEXTS (``n`` of them), TOKEN_IDS [n, length] and PLAN, the plan's JSON."""
    try:
        outputs = {o.name: (o, r) for o, r in zip(response.outputs, response.raw_output_contents)}
        texts = deserialize_bytes_tensor(outputs["TEXTS"][1])
        ids, plan = outputs["TOKEN_IDS"], deserialize_bytes_tensor(outputs["PLAN"][1])
        return len(texts) == n and len(ids[1]) == 8 * int(np.prod(ids[0].shape)) and isinstance(json.loads(plan[0]), dict)
    except (KeyError, IndexError, ValueError):
        return False


def stream_refusal(message: str) -> str:
    """A stream's in-band refusal (``error_message``) carries no status: the server's words say which it is
    (serve/api/errors.error_status's messages): an internal error 500; a full queue or a deadline out of reach,
    which say when to retry, 503; a timeout 504; too large even on an idle server 413; the rest the request's fault."""
    if "internal error" in message:
        return "refused:500"
    if "retry" in message:
        return "refused:503"
    if "timed out" in message:
        return "refused:504"
    return "refused:413" if "even on an idle server" in message else "refused:400"


def infer_call(client: GrpcClient, route: str, request: Any) -> None:
    """One ModelInfer call, classified; counted by the server under its model when the model is a served graph
    and the server's handler answered."""
    start, clock = time.time(), time.perf_counter()
    try:
        outcome, handled = ("answered" if infer_parses(client.stub.ModelInfer(request, timeout=120)) else "unparseable"), True
    except grpc.RpcError as error:
        outcome, handled = rpc_outcome(error)
        if not handled:
            client.reopen()
    label = request.model_name if handled and request.model_name in GRAPH_NAMES else None  # grpc_kserve counts served graphs only
    record(route, outcome, 1000 * (time.perf_counter() - clock), label, start)


def stream_call(client: GrpcClient, route: str, request: Any, leave: bool = False) -> None:
    """One ldlm_generate request on a stream of its own, classified by the responses that came back: its result,
    or its in-band refusal. ``leave``: the client cancels the stream at the first preview. Every request that
    the server answered anything to is counted by it, under "generate"."""
    start, clock = time.time(), time.perf_counter()
    call = client.stub.ModelStreamInfer(iter([request]), timeout=120)
    n = next((int(t.contents.int64_contents[0]) for t in request.inputs if t.name == "N"), 0)
    outcome, handled = "no answer (the stream ended without a result)", False
    try:
        for response in call:
            handled = True
            if response.error_message:
                outcome = stream_refusal(response.error_message)
            elif response.infer_response.parameters["triton_final_response"].bool_param:
                outcome = "answered" if result_parses(response.infer_response, n) else "unparseable"
            elif leave:
                call.cancel()
                outcome = "left"
                break
    except grpc.RpcError as error:
        outcome, reached = rpc_outcome(error)
        handled = handled or reached
        if not reached:
            client.reopen()
    record(route, outcome, 1000 * (time.perf_counter() - clock), GENERATE_LABEL if handled else None, start)


def encoder_grpc(seq: int = 16) -> Any:
    """A ModelInfer request for the encoder, its two inputs as raw_input_contents (as tritonclient sends them)."""
    request = service_pb2.ModelInferRequest(model_name="encoder")
    ids = np.random.default_rng().integers(0, 50000, (1, seq), dtype=np.int64)
    for name, values in (("input_ids", ids), ("attention_mask", np.ones((1, seq), np.int64))):
        request.inputs.add(name=name, datatype="INT64", shape=list(values.shape))
        request.raw_input_contents.append(values.tobytes())
    return request


def generate_grpc(inputs: dict[str, int], preview_every: int = 0) -> Any:
    """A ModelInferRequest for ldlm_generate: each input one INT64 value of shape [1], in typed contents."""
    request = service_pb2.ModelInferRequest(model_name="ldlm_generate")
    for name, value in inputs.items():
        request.inputs.add(name=name, datatype="INT64", shape=[1]).contents.int64_contents.append(value)
    if preview_every:
        request.parameters["preview_every"].int64_param = preview_every
    return request


def hostile_infer(case: str) -> Any:
    """A ModelInfer request with the one fault ``case`` names (GRPC_HOSTILE_INFER)."""
    request = encoder_grpc()
    if case == "wrong datatype":  # FP32 values of the right size for an INT64 input
        request.inputs[0].datatype = "FP32"
        request.raw_input_contents[0] = np.ones((1, 16), np.float32).tobytes()
    elif case == "shape and data disagree":  # [1, 16] declared, 8 values sent
        request.raw_input_contents[0] = np.ones((1, 8), np.int64).tobytes()
    elif case == "raw contents for one of two inputs":
        del request.raw_input_contents[1]
    elif case == "unknown model":
        request.model_name = "nope"
    elif case == "unknown input":
        request.inputs[0].name = "input_idz"
    elif case == "NaN in FP32 contents":
        request = service_pb2.ModelInferRequest(model_name="decoder")
        latents = np.zeros((1, 8, D_MODEL), np.float32)
        latents[0, 0, 0] = np.nan
        request.inputs.add(name="latents", datatype="FP32", shape=[1, 8, D_MODEL]).contents.fp32_contents.extend(latents.ravel().tolist())
        request.inputs.add(name="attention_mask", datatype="INT64", shape=[1, 8]).contents.int64_contents.extend([1] * 8)
    elif case == "message above the size cap":  # the server's default --max-body-mb, which the soak's server runs with
        request.raw_input_contents[0] = bytes(ServerSettings.max_body_bytes + (1 << 20))
    return request


GRPC_HOSTILE_INFER = (  # each must be refused 4xx, never INTERNAL or UNKNOWN
    "wrong datatype",
    "shape and data disagree",
    "raw contents for one of two inputs",
    "unknown model",
    "unknown input",
    "NaN in FP32 contents",
    "message above the size cap",
)
GRPC_HOSTILE_STREAM = {  # each must be refused in the stream, as a client error
    "generate N=0": {"N": 0, "LENGTH": 16, "STEPS": 4},
    "generate without LENGTH": {"N": 1, "STEPS": 4},
}


class Traffic(User):
    """The mix: KServe on each graph (JSON and binary), /v1/generate plain and streamed with previews, with and
    without a prompt, OpenAI completions plain and streamed through the openai client, hostile bodies; over gRPC
    (where the server has an endpoint), ModelInfer on the encoder, small ldlm_generate streams with and without
    previews, and hostile messages of both."""

    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        self.client_ = httpx.Client(base_url=self.host)
        self.grpc = GrpcClient(GRPC) if GRPC else None

    def on_stop(self) -> None:
        self.client_.close()
        if self.grpc is not None:
            self.grpc.channel.close()

    @task(4)
    def kserve(self) -> None:
        kind = random.choice(["encoder-json", "encoder-binary", "denoiser", "decoder"])
        if kind == "encoder-binary":
            body, headers = encoder_binary()
            send(self.client_, "kserve encoder binary", "/v2/models/encoder/infer", content=body, headers=headers)
        elif kind == "encoder-json":
            send(self.client_, "kserve encoder json", "/v2/models/encoder/infer", json=encoder_json())
        else:
            send(self.client_, f"kserve {kind} json", f"/v2/models/{kind}/infer", json=latents_json(kind))

    @task(4)
    def generate(self) -> None:
        small = {"n": 1, "length": 16, "steps": 4, "seed": random.randrange(1000)}
        send(self.client_, "generate small", "/v1/generate", leave=random.random() < LEAVE_SHARE, json=small)

    @task(2)
    def generate_stream(self) -> None:
        body = {"n": 2, "length": 24, "steps": 10, "stream": True, "preview_every": 2, "prompt": random.choice(["", PROMPT])}
        send(self.client_, "generate stream", "/v1/generate", leave=random.random() < LEAVE_SHARE, json=body)

    @task(2)
    def completion(self) -> None:
        stream, temperature = random.random() < 0.5, random.choice([0.0, 0.8])
        body = {
            "model": "ldlm",
            "prompt": random.choice(["", PROMPT]),
            "max_tokens": 8,
            "temperature": temperature,
            "stream": stream,
            "steps": 4,
        }
        send(
            self.client_,
            f"completions {'stream' if stream else 'plain'}",
            "/v1/completions",
            leave=random.random() < LEAVE_SHARE,
            json=body,
        )

    @task(1)
    def openai_client(self) -> None:
        """The official client, as users call it, plain and streamed (its own connection handling, no retries)."""
        import openai

        start, clock = time.time(), time.perf_counter()
        try:
            stream = random.random() < 0.5
            with openai.OpenAI(base_url=f"{self.host}/v1", api_key="unused", max_retries=0, timeout=120) as client:
                made = client.completions.create(model="ldlm", prompt=PROMPT, max_tokens=8, stream=stream, extra_body={"steps": 4})
                choices = [c for chunk in made for c in chunk.choices] if stream else made.choices
            outcome = "answered" if choices and all(isinstance(c.text, str) for c in choices) else "unparseable"
        except openai.APIStatusError as error:
            outcome = f"refused:{error.status_code}"
        except openai.APIConnectionError as error:
            outcome = lost(error.__cause__ or error)
        record("openai client", outcome, 1000 * (time.perf_counter() - clock), model_of("/v1/completions"), start)

    @task(1)
    def hostile(self) -> None:
        path, body = random.choice(HOSTILE)
        send(self.client_, "hostile", path, content=body, headers={"Content-Type": "application/json"})

    @task(2)
    def grpc_infer(self) -> None:
        if self.grpc is not None:
            infer_call(self.grpc, "grpc infer", encoder_grpc())

    @task(2)
    def grpc_generate(self) -> None:
        """A small generation on its own stream; 10% ask for a preview every step and leave at the first."""
        if self.grpc is not None:
            leave = random.random() < LEAVE_SHARE
            every = 1 if leave else random.choice([0, 2])
            inputs = {"N": 1, "LENGTH": 16, "STEPS": 4, "SEED": random.randrange(1000)}
            stream_call(self.grpc, "grpc generate", generate_grpc(inputs, every), leave=leave)

    @task(1)
    def grpc_hostile(self) -> None:
        """Every hostile gRPC case in turn, each a route of its own: a short run still sends them all."""
        if self.grpc is not None:
            for case in GRPC_HOSTILE_INFER:
                infer_call(self.grpc, f"grpc hostile {case}", hostile_infer(case))
            for case, inputs in GRPC_HOSTILE_STREAM.items():
                stream_call(self.grpc, f"grpc hostile {case}", generate_grpc(inputs))


class Burst(User):
    """Now and then, more small generations at once than the server queues: the rest must be 503 with Retry-After."""

    wait_time = between(20, 40)
    weight = 0
    fixed_count = 1

    @task
    def burst(self) -> None:
        with httpx.Client(base_url=self.host, limits=httpx.Limits(max_connections=BURST)) as client:
            body = {"n": 1, "length": 16, "steps": 40}
            jobs = [gevent.spawn(send, client, "burst", "/v1/generate", json=body) for _ in range(BURST)]
            gevent.joinall(jobs)


@events.quitting.add_listener
def write_counts(environment: Any, **_: Any) -> None:
    """This process's counts and per-minute latencies, for soak.py to add up."""
    OUT.mkdir(parents=True, exist_ok=True)
    data = {
        "outcomes": [[route, outcome, n] for (route, outcome), n in outcomes.items()],
        "latencies": [[route, minute, values] for (route, minute), values in latencies.items()],
        "sent": sent_after,
        "started": started,
    }
    path = OUT / f"traffic-{os.getpid()}.json"
    path.with_suffix(".tmp").write_text(json.dumps(data))
    path.with_suffix(".tmp").replace(path)
