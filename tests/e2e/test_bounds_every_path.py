"""Every bound of ldlm/limits.py at both edges (the last value allowed, the first refused) on every path that
takes it: the Python API (``LDLMPipeline.generate``, the request plan, ``TokenSampling``, ``ServerSettings``),
the CLI (``ldlm generate``, ``ldlm serve``, run in-process through ``main``), and the real server on 127.0.0.1
(/v1/generate, its stream, /v1/completions through the official ``openai`` client, /v1/encode and
/v1/reconstruct through httpx, and ``ldlm_generate`` through tritonclient: its gRPC stream, with its
``preview_every`` parameter, and its infer requests over HTTP and gRPC, its FP32 inputs at float32's edges and
each refusal naming the input as sent).

The cases come from the table itself (``SETTINGS``, ``body_ranges``), so a new bound is tested on every path
that has a field or option of its name; the edges come from ``documented_body`` and ``DOCUMENTED_SETTINGS``
below, the ranges written out by hand as the docs, ``--help`` and OpenAI's API reference give them, never read
from ``ldlm.limits``. A bound the table widens or narrows is then a value some path accepts or refuses against
what is documented, and a bound the table gains fails here until its documented range is written out."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

httpx = pytest.importorskip("httpx", reason="the test client (pip install -e .[test])")
openai = pytest.importorskip("openai", reason="the OpenAI client (pip install -e .[test])")
grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient's gRPC client (pip install -e .[test])")
httpclient = pytest.importorskip("tritonclient.http", reason="tritonclient's HTTP client (pip install -e .[test])")

from tritonclient.utils import InferenceServerException  # noqa: E402

from ldlm.cli import build_parser, main  # noqa: E402
from ldlm.limits import MAX_N, MAX_STEPS, SETTINGS, body_ranges  # noqa: E402
from ldlm.model.config import LDLMConfig, preset  # noqa: E402
from ldlm.pipeline import LDLMPipeline  # noqa: E402
from ldlm.sampling import GenerateRequest, RequestLimits, resolve  # noqa: E402
from ldlm.sampling.tokens import TokenSampling  # noqa: E402
from ldlm.serve.api.kserve_models import GENERATE_INPUTS  # noqa: E402
from ldlm.serve.api.openai_schemas import completion_body  # noqa: E402
from ldlm.serve.api.schemas import BodyLimits, request_models  # noqa: E402
from ldlm.serve.api.service import LDLMService, ServerSettings  # noqa: E402
from tests.servers import RunningServer, free_port, openai_client  # noqa: E402


@dataclass(frozen=True)
class Documented:
    """An interval as the documentation states it; ``integer``: a count, else any real number in it."""

    low: float
    high: float
    low_open: bool = False
    high_open: bool = False
    integer: bool = True

    def edges(self) -> list[tuple[str, float, bool]]:
        """(which edge, value, allowed) at each end: the last value inside, the first outside."""
        if self.integer:
            low, high = int(self.low), self.high if math.isinf(self.high) else int(self.high)
            return [("low", low, True), ("below low", low - 1, False), ("high", high, True), ("above high", high + 1, False)]
        inner_low = math.nextafter(self.low, math.inf) if self.low_open else self.low
        outer_low = self.low if self.low_open else math.nextafter(self.low, -math.inf)
        inner_high = math.nextafter(self.high, -math.inf) if self.high_open else self.high
        outer_high = self.high if self.high_open else math.nextafter(self.high, math.inf)
        return [("low", inner_low, True), ("below low", outer_low, False), ("high", inner_high, True), ("above high", outer_high, False)]

    def named(self) -> str:
        """How a refusal names the interval: ``1..64``, ``(0, 1]``, ``an integer >= 1`` (no upper end)."""
        if self.integer and math.isinf(self.high):
            return f"an integer >= {int(self.low)}"
        if self.integer:
            return f"{int(self.low)}..{int(self.high)}"
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


def number(low: float, high: float, low_open: bool = False, high_open: bool = False) -> Documented:
    return Documented(low, high, low_open, high_open, integer=False)


# The caps of the server under test (small, so a request at a cap is cheap) and the tiny model's max_seq_len.
CAPS = {"max_n": 3, "max_steps": 4, "max_texts": 2, "max_seq_len": preset("tiny").max_seq_len, "max_timeout_s": 30.0}


def documented_body(max_n: int, max_steps: int, max_texts: int, max_seq_len: int, max_timeout_s: float) -> dict[str, Documented]:
    """The request fields' ranges on a server with these caps (docs/serving.md; OpenAI's for its names)."""
    return {
        "n": Documented(1, max_n),
        "length": Documented(1, max_seq_len),  # a prompt's tokens included
        "max_tokens": Documented(1, max_seq_len),  # with an empty prompt
        "min_tokens": Documented(0, max_seq_len),  # vLLM's; and at most the request's max_tokens
        "steps": Documented(1, max_steps),
        "preview_every": Documented(1, max_steps),  # a preview every k steps, k >= 1
        "seed": Documented(0, 2**63 - 1),  # a signed 64-bit integer, as Triton's INT64 input
        "texts": Documented(1, max_texts),
        "t_min": number(0, 1, low_open=True, high_open=True),
        "prior_temperature": number(0, 1, low_open=True),
        "prompt_strength": number(0, 4),
        "temperature": number(0, 2),  # OpenAI's range
        "top_p": number(0, 1, low_open=True),
        "logprobs": Documented(0, 5),  # OpenAI's legacy completions
        "timeout_s": number(0, max_timeout_s, low_open=True),  # at most the server's request timeout
    }


SECONDS = number(0, 86400, low_open=True)  # finite, at most a day
BUDGET = number(0, 1, low_open=True)  # a share of wall time
DOCUMENTED_SETTINGS: dict[str, Documented] = {  # `ldlm serve --help`, docs/serving.md
    "port": Documented(0, 65535),
    "grpc_port": Documented(0, 65535),
    "max_batch": Documented(1, 65536),
    "max_queue": Documented(1, 2**20),
    "max_body_bytes": Documented(1024, 2**31),
    "max_n": Documented(1, 65536),
    "max_steps": Documented(1, 2**20),
    "max_texts": Documented(1, 65536),
    "max_request_samples": Documented(1, 2**20),
    "max_request_tokens": Documented(1, 2**30),
    "max_connections": Documented(1, 2**20),
    "max_delay_ms": number(0, 60000),
    "request_timeout_s": SECONDS,
    "header_timeout_s": SECONDS,
    "body_timeout_s": SECONDS,
    "keep_alive_s": SECONDS,
    "preview_budget": BUDGET,
    "preview_lone_budget": BUDGET,
    "threads": Documented(1, 1024),
}

BODY_FIELDS = sorted(body_ranges(**CAPS))
EDGES = ["low", "below low", "high", "above high"]


def edge(allowed: Documented, which: str) -> tuple[float, bool]:
    return next((value, inside) for name, value, inside in allowed.edges() if name == which)


def body_bound(field: str, **caps: Any) -> Documented:
    """The documented range of a request field, failing for a field of the table that the documentation lacks."""
    documented = documented_body(**{**CAPS, **caps})
    assert field in documented, f"ldlm.limits.body_ranges bounds {field!r}, which documented_body lacks: document it, then add it there"
    return documented[field]


def test_the_table_is_the_documented_ranges() -> None:
    table = {**{f"body.{k}": v for k, v in body_ranges(**CAPS).items()}, **SETTINGS}
    documented = {**{f"body.{k}": v for k, v in documented_body(**CAPS).items()}, **DOCUMENTED_SETTINGS}
    assert set(table) == set(documented)
    for name, allowed in table.items():
        expected = documented[name]
        found = (allowed.low, allowed.high, allowed.low_open, allowed.high_open, not allowed.number)
        assert found == (expected.low, expected.high, expected.low_open, expected.high_open, expected.integer), name


def refusal_names(message: str, value: float, allowed: Documented) -> None:
    """A refusal names the value and the whole range, both ends where it has two."""
    named = allowed.named()
    assert f"allowed: {named}" in message or f"allowed: a number in {named}" in message, message
    shown = {json.dumps(value), repr(value), str(value)}
    assert any(s in message for s in shown), f"{message!r} does not name {value!r}"


# --- the Python API ------------------------------------------------------------------------------


GENERATE_ARGS = set(inspect.signature(LDLMPipeline.generate).parameters)
SAMPLING_ARGS = {"temperature": "temperature", "top_p": "top_p", "logprobs": "top_logprobs"}  # TokenSampling's names


@pytest.fixture
def no_denoising(monkeypatch: pytest.MonkeyPatch) -> None:
    """The denoising loop replaced by zero latents: every bound is checked before its first step (the plan), and a
    request at a cap (1000 steps) is then as quick as one at the floor."""
    monkeypatch.setattr(LDLMPipeline, "run_plan", lambda self, plan, *args: torch.zeros(plan.n, plan.length, self.config.d_model))


UNCAPPED = ("n", "steps")  # a Python caller of the pipeline has no cap on these (a server's or Triton's: the plan's)


@pytest.mark.parametrize("which", EDGES)
@pytest.mark.parametrize("field", [f for f in BODY_FIELDS if f in GENERATE_ARGS or f in SAMPLING_ARGS])
def test_python_api(field: str, which: str, pipeline: LDLMPipeline, no_denoising: None) -> None:
    allowed = body_bound(field, max_seq_len=pipeline.config.max_seq_len)
    if field in UNCAPPED:
        if which in ("high", "above high"):
            pytest.skip("no upper end: the request plan's test takes a caller's cap")
        allowed = Documented(1, math.inf)
    value, inside = edge(allowed, which)
    if field in SAMPLING_ARGS:
        run: Callable[[], Any] = lambda: TokenSampling(**{SAMPLING_ARGS[field]: value})  # noqa: E731
    else:
        run = lambda: pipeline.generate(**{"n": 1, "length": 4, "steps": 1, field: value})  # noqa: E731
    if inside:
        run()
        return
    with pytest.raises(ValueError) as refused:
        run()
    refusal_names(str(refused.value), value, allowed)


PLAN_FIELDS = [f for f in BODY_FIELDS if f in {x.name for x in dataclasses.fields(GenerateRequest)}]


@pytest.mark.parametrize("which", EDGES)
@pytest.mark.parametrize("field", PLAN_FIELDS)
def test_request_plan(field: str, which: str, tiny_config: LDLMConfig) -> None:
    """``ldlm.sampling.resolve`` with a caller's caps, as the server's and Triton's are."""
    allowed = body_bound(field, max_seq_len=tiny_config.max_seq_len)
    value, inside = edge(allowed, which)
    request = GenerateRequest(**{"n": 1, "length": 4, "steps": 1, field: value})
    limits = RequestLimits(max_n=CAPS["max_n"], max_steps=CAPS["max_steps"])
    if inside:
        assert getattr(resolve(request, tiny_config, limits), field) == value
        return
    with pytest.raises(ValueError) as refused:
        resolve(request, tiny_config, limits)
    refusal_names(str(refused.value), value, allowed)


@pytest.mark.parametrize("which", EDGES)
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_server_settings(name: str, which: str) -> None:
    assert name in DOCUMENTED_SETTINGS, f"ldlm.limits.SETTINGS bounds {name!r}, which DOCUMENTED_SETTINGS lacks"
    allowed = DOCUMENTED_SETTINGS[name]
    value, inside = edge(allowed, which)
    if inside:
        assert getattr(ServerSettings(**{name: value}), name) == value
        return
    with pytest.raises(ValueError) as refused:
        ServerSettings(**{name: value})
    refusal_names(str(refused.value), value, allowed)


# --- the CLI -------------------------------------------------------------------------------------


def options_of(command: str) -> dict[str, str]:
    """A subcommand's options by destination: {"prior_temperature": "--prior-temperature", ...}."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a.option_strings[-1] for a in sub.choices[command]._actions if a.option_strings}


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``ldlm ARGV`` in this process: its exit code (argparse's 2 included) and its stderr."""
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = int(exit_info.code or 0)
    return code, capsys.readouterr().err


# What `ldlm generate` caps at: ldlm serve's default max_n and max_steps, and the checkpoint's max_seq_len.
CLI_CAPS = {"max_n": MAX_N, "max_steps": MAX_STEPS}
GENERATE_OPTIONS = options_of("generate")


@pytest.mark.parametrize("which", EDGES)
@pytest.mark.parametrize("field", [f for f in BODY_FIELDS if f in GENERATE_OPTIONS])
def test_ldlm_generate(
    field: str,
    which: str,
    tiny_checkpoint: Path,
    pipeline: LDLMPipeline,
    no_denoising: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """In-process, on the tiny checkpoint loaded once (the session's pipeline of it)."""
    monkeypatch.setattr(LDLMPipeline, "from_checkpoint", lambda checkpoint, device="cpu": pipeline)
    allowed = body_bound(field, **CLI_CAPS)
    value, inside = edge(allowed, which)
    given = {"n": 1, "length": 4, "steps": 1, field: value}
    argv = ["generate", str(tiny_checkpoint), "--quiet", "--json", *(f"{GENERATE_OPTIONS[k]}={v!r}" for k, v in given.items())]
    code, err = run_cli(argv, capsys)
    if inside:
        assert code == 0, err
        return
    assert code == 2, err
    refusal_names(err, value, allowed)


# `ldlm serve`'s option for a setting, where its name differs; max_body_bytes is given in MiB.
SERVE_ALIASES = {"request_timeout_s": "timeout_s", "max_body_bytes": "max_body_mb"}
SERVE_OPTIONS = options_of("serve")
MIB = 1 << 20


@pytest.mark.parametrize("which", EDGES)
@pytest.mark.parametrize("name", [n for n in sorted(SETTINGS) if SERVE_ALIASES.get(n, n) in SERVE_OPTIONS])
def test_ldlm_serve(name: str, which: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Up to the server's start (replaced): the settings the options made, or the option's refusal."""
    import ldlm.serve.api.server as server

    started: dict[str, ServerSettings] = {}
    monkeypatch.setattr(server, "serve", lambda source, settings, log_level: started.update(settings=settings))
    monkeypatch.setenv("LDLM_CACHE_DIR", str(tmp_path))
    allowed = DOCUMENTED_SETTINGS[name]
    if name == "max_body_bytes":  # whole MiB: 1 MiB up to the setting's own cap
        allowed = Documented(1, allowed.high // MIB)
    value, inside = edge(allowed, which)
    code, err = run_cli(["serve", "ckpt", f"{SERVE_OPTIONS[SERVE_ALIASES.get(name, name)]}={value!r}"], capsys)
    if inside:
        assert code == 0, err
        assert getattr(started["settings"], name) == (value * MIB if name == "max_body_bytes" else value)
        return
    assert code == 2 and not started, err
    refusal_names(err, value, allowed)


# --- the HTTP API --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[RunningServer]:
    """The tiny checkpoint on the eager backend (nothing to export), with small caps: a request at a cap is cheap."""
    caps = {k: v for k, v in CAPS.items() if k in ("max_n", "max_steps", "max_texts")}
    settings = ServerSettings(
        port=free_port(),
        grpc_port=free_port(),
        backend="eager",
        request_timeout_s=CAPS["max_timeout_s"],
        **caps,  # type: ignore[arg-type]
    )
    running = RunningServer(LDLMService(str(tiny_checkpoint), settings))
    yield running
    running.stop()


BODIES = request_models(BodyLimits(**CAPS))  # the fields each route's body has
GENERATE_FIELDS = [f for f in BODY_FIELDS if f in BODIES.generate.model_fields]


# What answers a deadline of 5e-324 s, the smallest timeout_s in range: taken as a deadline, it is late (504), or
# known to be late before it runs (413 alone, 503 behind other work); never refused as out of range (422).
DEADLINE_ANSWERS = {413, 503, 504}


def taken_as_deadline(field: str, which: str) -> bool:
    return field == "timeout_s" and which == "low"


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("which", EDGES)
@pytest.mark.parametrize("field", GENERATE_FIELDS)
def test_v1_generate(field: str, which: str, stream: bool, server: RunningServer) -> None:
    allowed = body_bound(field)
    value, inside = edge(allowed, which)
    response = httpx.post(f"{server.url}/v1/generate", json={"n": 1, "length": 4, "steps": 1, "stream": stream, field: value}, timeout=60)
    if taken_as_deadline(field, which):
        assert response.status_code in DEADLINE_ANSWERS, response.text
    elif inside:
        assert response.status_code == 200, response.text
        assert not stream or "event: result" in response.text, response.text[-500:]
    else:
        assert response.status_code == 422, response.text
        refusal_names(response.json()["error"], value, allowed)


@pytest.mark.parametrize("which", EDGES)
@pytest.mark.parametrize("path", ["/v1/encode", "/v1/reconstruct"] if "texts" in BODIES.texts.model_fields else [])
def test_v1_texts(path: str, which: str, server: RunningServer) -> None:
    allowed = body_bound("texts")
    count, inside = edge(allowed, which)
    response = httpx.post(f"{server.url}{path}", json={"texts": ["a b"] * int(count)}, timeout=60)
    if inside:
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 422, response.text
    assert f"texts: {int(count)} items is out of range; allowed: {allowed.named()}" in response.json()["error"]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[Any]:
    with openai_client(server) as client:
        yield client


# The fields the official client names (OpenAI's); the rest are LDLM's, sent as extra body fields.
OPENAI_NAMED = set(inspect.signature(openai.resources.Completions.create).parameters)
COMPLETION_FIELDS = [f for f in BODY_FIELDS if f in completion_body(BodyLimits(**CAPS)).model_fields]


@pytest.mark.parametrize("which", EDGES)
@pytest.mark.parametrize("field", COMPLETION_FIELDS)
def test_v1_completions(field: str, which: str, server: RunningServer, client: Any) -> None:
    allowed = body_bound(field)
    value, inside = edge(allowed, which)
    named: dict[str, Any] = {"n": 1, "max_tokens": 4}
    extra: dict[str, Any] = {"steps": 1}
    if field == "min_tokens":  # bounded by max_tokens too: ask for the most tokens, so the field's own bound is the edge
        named["max_tokens"] = int(body_bound("max_tokens").high)
    (named if field in OPENAI_NAMED else extra)[field] = value
    create = lambda: client.completions.create(model="ldlm", prompt="", extra_body=extra, **named)  # noqa: E731
    if taken_as_deadline(field, which):
        with pytest.raises(openai.APIStatusError) as late:
            create()
        assert late.value.status_code in DEADLINE_ANSWERS, late.value.message
    elif inside:
        assert len(create().choices) == named["n"]
    else:
        with pytest.raises(openai.BadRequestError) as refused:
            create()
        refusal_names(refused.value.message, value, allowed)


@pytest.mark.parametrize("which", EDGES)
def test_v1_completions_prompts(which: str, server: RunningServer, client: Any) -> None:
    """A list of prompts is as long as /v1/encode's texts may be (max_texts): n choices each."""
    allowed = body_bound("texts")
    count, inside = edge(allowed, which)
    create = lambda: client.completions.create(model="ldlm", prompt=["a"] * int(count), max_tokens=4, extra_body={"steps": 1})  # noqa: E731
    if inside:
        assert len(create().choices) == count
        return
    with pytest.raises(openai.BadRequestError) as refused:
        create()
    message, named = refused.value.message, allowed.named()
    if count:
        assert f"prompt has {int(count)} items; allowed: {named}" in message, message
    else:
        assert "prompt is an empty list;" in message and f"a list of {named} texts" in message, message


# --- gRPC's ldlm_generate stream -----------------------------------------------------------------

# Its inputs are /v1/generate's fields in upper case (kserve_models.GENERATE_INPUTS), one value each
GRPC_INPUTS = {tensor.field: tensor for tensor in GENERATE_INPUTS}
DATATYPES = {tensor.name: tensor.datatype for tensor in GENERATE_INPUTS}
GRPC_FIELDS = [f for f in BODY_FIELDS if f in GRPC_INPUTS]


def grpc_edge(allowed: Documented, which: str, datatype: str) -> tuple[float, bool] | None:
    """The edge as the input's datatype holds it: an FP32 input's edges are float32's neighbours of the ends
    (float64's would round onto the end itself); None where INT64 cannot hold the value at all."""
    value, inside = edge(allowed, which)
    if datatype == "FP32" and not allowed.integer:
        end = np.float32(allowed.low if "low" in which else allowed.high)
        toward = np.float32(np.inf if (which in ("low", "above high")) else -np.inf)
        stays = (which == "low" and not allowed.low_open) or (which == "high" and not allowed.high_open)
        outside_open = (which == "below low" and allowed.low_open) or (which == "above high" and allowed.high_open)
        value = float(end if stays or outside_open else np.nextafter(end, toward))
    if datatype == "INT64" and not -(2**63) <= value < 2**63:
        return None
    return value, inside


def edge_inputs(module: Any, field: str, which: str) -> tuple[list[Any], float, bool, Documented]:
    """ldlm_generate's inputs for one edge of ``field`` as ``module``'s (tritonclient.grpc's or .http's) InferInputs:
    the tensors, the value at the edge, whether it is inside, and the documented range; skipped where the input's
    datatype cannot hold the value."""
    spec = GRPC_INPUTS[field]
    allowed = body_bound(field)
    given = grpc_edge(allowed, which, spec.datatype)
    if given is None:
        pytest.skip(f"{spec.name}: {which} of {allowed.named()} does not fit {spec.datatype}; the transport cannot carry it")
    value, inside = given
    tensors = []
    for name, number in {"N": 1, "LENGTH": 4, "STEPS": 1, spec.name: value}.items():
        tensor = module.InferInput(name, [1], DATATYPES[name])
        tensor.set_data_from_numpy(np.array([number], dtype=np.int64 if DATATYPES[name] == "INT64" else np.float32))
        tensors.append(tensor)
    return tensors, value, inside, allowed


def refused_by_name(message: str, field: str, value: float, allowed: Documented) -> None:
    """An ldlm_generate refusal names the input as the request did (N=0, T_MIN=1.0), then the whole range: the
    model's own check, not a later one in /v1/generate's words."""
    refusal_names(message, value, allowed)
    assert f"{GRPC_INPUTS[field].name}={value!r} is out of range; allowed: " in message, message


def stream_answer(server: RunningServer, tensors: list[Any], parameters: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """The first answer of one ldlm_generate request on a gRPC stream: (result, error)."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.service.settings.grpc_port}")
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer("ldlm_generate", tensors, parameters=parameters)
        return answers.get(timeout=60)
    finally:
        client.stop_stream()


@pytest.mark.parametrize("which", EDGES)
@pytest.mark.parametrize("field", GRPC_FIELDS)
def test_grpc_generate_stream(field: str, which: str, server: RunningServer) -> None:
    tensors, value, inside, allowed = edge_inputs(grpcclient, field, which)
    result, error = stream_answer(server, tensors)
    if inside:
        assert error is None and result.get_response().parameters["triton_final_response"].bool_param, error
        return
    assert result is None and error is not None, (field, value)
    refused_by_name(error.message(), field, value, allowed)


@pytest.mark.parametrize("which", EDGES)
@pytest.mark.parametrize("transport", ["http", "grpc"])
@pytest.mark.parametrize("field", GRPC_FIELDS)
def test_kserve_generate_infer(field: str, transport: str, which: str, server: RunningServer) -> None:
    """ldlm_generate's ModelInfer, as tritonclient's HTTP and gRPC clients call it: 400 (INVALID_ARGUMENT) naming the range."""
    module = httpclient if transport == "http" else grpcclient
    tensors, value, inside, allowed = edge_inputs(module, field, which)
    port = server.service.settings.port if transport == "http" else server.service.settings.grpc_port
    client = module.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        if inside:
            shape = (value if field == "n" else 1, value if field == "length" else 4)
            assert client.infer("ldlm_generate", tensors).as_numpy("TOKEN_IDS").shape == shape
            return
        with pytest.raises(InferenceServerException) as refused:
            client.infer("ldlm_generate", tensors)
    finally:
        client.close()
    assert refused.value.status() in ("400", "StatusCode.INVALID_ARGUMENT"), refused.value
    refused_by_name(refused.value.message(), field, value, allowed)


@pytest.mark.parametrize("case", ["below 0", "0", "low", "high", "above high"])
def test_grpc_stream_preview_every(case: str, server: RunningServer) -> None:
    """The stream's request parameter preview_every, in the range of /v1/generate's field, except that 0 (the
    parameter's default) asks for none. At STEPS = the cap, a preview every k < STEPS steps comes first; at k = STEPS
    the result does."""
    allowed = body_bound("preview_every")
    every = {"below 0": -1, "0": 0, **{which: int(edge(allowed, which)[0]) for which in ("low", "high", "above high")}}[case]
    tensors, steps, *_ = edge_inputs(grpcclient, "steps", "high")
    result, error = stream_answer(server, tensors, {"preview_every": every})
    if case in ("below 0", "above high"):
        assert result is None and error is not None, every
        refusal_names(error.message(), every, allowed)
        return
    assert error is None, error
    assert result.get_response().parameters["triton_final_response"].bool_param is (every in (0, steps))
