"""The soak's traffic, as a Locust file (run headless by scripts/research/soak.py; not on its own).

Every request is sent with httpx (or the official ``openai`` client) to 127.0.0.1 and classified by what came
back, never by what was hoped for:

  answered        2xx and a body that parses (JSON, KServe binary, or Server-Sent Events ending in a result)
  refused:<code>  4xx/5xx with the one error shape (503 must carry Retry-After, else it is ``503 without Retry-After``)
  left              the client itself gave up mid-request (10% of generations and completions do, on purpose)
  server down       no connection while the soak was stopping or had stopped the server (a marker file says so)
  killed in flight  connected, then cut off by the soak's SIGKILL (expected of a killed process)
  no connection     no connection while the server was up
  no answer         connected and sent, then no status: a lost request (a SIGTERM must never cause one)
  unparseable       a status with a body that does not parse
  (replica killed)  a 5xx while the soak had killed one of Ray's replicas, counted apart

Each Locust process writes its counts and per-minute latencies to ``$SOAK_OUT/traffic-<pid>.json`` when it quits.
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
import httpx
import numpy as np
from locust import User, between, events, task

OUT = Path(os.environ.get("SOAK_OUT", "."))
DOWN = OUT / "server-down"  # present while the soak stops the server on purpose; it holds the signal's name
D_MODEL = int(os.environ.get("SOAK_D_MODEL", "64"))
LEAVE_SHARE = 0.1
BURST = int(os.environ.get("SOAK_BURST", "160"))  # above the server's generation queue: some must be refused 503
PROMPT = "Mr. Darcy looked at Elizabeth and"

outcomes: Counter[tuple[str, str]] = Counter()
latencies: dict[tuple[str, int], list[float]] = defaultdict(list)  # (route, minute) -> ms of answered requests
sent_after: list[tuple[float, str, str]] = []  # (start wall time, model label as the server counts it, outcome)
started = time.time()


def model_of(path: str) -> str:
    """The label the server's request counters use for ``path`` (ldlm.serve.api.http_guard._model_of)."""
    parts = path.split("/")
    return parts[3] if path.startswith("/v2/models/") else parts[2]


def record(route: str, outcome: str, ms: float, path: str, start: float) -> None:
    outcomes[(route, outcome)] += 1
    sent_after.append((start, model_of(path), outcome))
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
    record(route, outcome, 1000 * (time.perf_counter() - clock), path, start)


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


class Traffic(User):
    """The mix: KServe on each graph (JSON and binary), /v1/generate plain and streamed with previews, with and
    without a prompt, OpenAI completions plain and streamed through the openai client, hostile bodies."""

    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        self.client_ = httpx.Client(base_url=self.host)

    def on_stop(self) -> None:
        self.client_.close()

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
        record("openai client", outcome, 1000 * (time.perf_counter() - clock), "/v1/completions", start)

    @task(1)
    def hostile(self) -> None:
        path, body = random.choice(HOSTILE)
        send(self.client_, "hostile", path, content=body, headers={"Content-Type": "application/json"})


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
