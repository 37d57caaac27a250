"""Replay the cases a new user hit, and more of the same kind, against a real `ldlm serve` and the `ldlm` CLI.

A script that replays the cases found on a fresh clone, and more of the
same kind, gets no 500, no traceback, no silent acceptance of an unknown field, and no request
slowed by abandoned work. This is that script; it stays as a regression tool.

Setup: `ldlm init` makes a tiny checkpoint and `ldlm export` exports it, in a scratch folder; the
servers are `ldlm serve` child processes on 127.0.0.1 (scripts.harness.loopback).

1. CLI: caps (--steps, --n, --seed, --length, --t-min) refused in a second with one error line naming the
   value and the range; `init` errors name the user's path and never `overwrite=True`; `reconstruct` of a
   too-long text names the text and its token count; `triton-repo --cpu` prints no `docker run --gpus all`;
   the Python API's `reconstruct("hello")` is one text or a refusal, never 5 texts.
2. A plain server: abandoned non-streamed generations (the client gives up after 1 s) do not slow the
   next small one, and /metrics counts the cancelled (or refused) work; a short request beside long
   streamed ones answers in seconds; streamed previews on an idle server; loose input (booleans for
   integers, unknown and misspelled fields, OpenAI parameters the model cannot honour) refused naming
   the field; `stop` and `echo` work; range messages name the value and the range; malformed bodies,
   huge Content-Length, deep JSON, NaN tensors, wrong datatypes, unknown models, wrong methods: 4xx
   with a message naming the problem.
3. A server with LDLM_API_KEY set: /, /docs, /openapi.json open; every API route 401 without the key
   (or with a wrong one), 200 with it.

Every HTTP answer must also have a status other than 500 and no "Traceback" in its body; every CLI
run no "Traceback" on stderr. Each case is written to --out (JSON, atomically) with what was sent,
what was expected, what came back, and whether it passed; exit status 1 when any case failed.

    flock /tmp/ldlm-cpu.lock .venv/bin/python tests/e2e/replay_cases.py --out docs/measurements/replay-cases-2026-12-01.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from scripts.harness.loopback import free_port, start_server, stop_server
from scripts.harness.traffic import sse_events, write_report

SMALL_GENERATION = {"n": 1, "length": 8, "steps": 2}  # the follow-up request (normally ~0.02 s)
SMALL_AFTER_ABANDONED_S = 3.0  # "fast": the issue saw 57 s; one denoising step of the abandoned batch may still be in flight
SHORT_BESIDE_LONG_S = 5.0  # "seconds, not tens of seconds"
CLI_CAP_S = 5.0  # "well under 10 s"
CLI_CAP_RSS_MB = 1024.0  # "no big allocation": a billion samples or steps would take far more
LONG_TEXT = "hello" + " hello" * 199  # 200 GPT-2 tokens ("hello", then " hello" x 199)
LONG_TEXT_TOKENS = 200
MAX_SEED_TEXT = str(2**63 - 1)  # seeds are signed 64-bit integers everywhere (HTTP, CLI, Triton)
TEXT_NAMED = r"texts?\s*\[?\s*[01]\b|\btext #?[01]\b|hello hello"  # the text itself, or its place (texts[0], text 1)
OPEN_UNIT_RANGE = r"\(\s*0(\.0)?\s*,\s*1(\.0)?\s*\)|between 0 and 1|0\s*<\s*\w*\s*<\s*1"
UTF8_NAMED = r"utf-?8|unicode"
TEMP_NAME = r"/\.nope\.|\.tmp\b|ldlm-[a-z]+-\w{6,}"  # an internal temporary sibling or scratch folder


@dataclass
class Case:
    name: str
    sent: str
    expected: str
    observed: dict[str, Any]
    passed: bool


@dataclass
class Report:
    cases: list[Case] = field(default_factory=list)

    def add(self, name: str, sent: str, expected: str, observed: dict[str, Any], passed: bool) -> bool:
        self.cases.append(Case(name, sent, expected, observed, passed))
        print(f"{'pass' if passed else 'FAIL'}  {name}  {json.dumps(observed)[:200]}", flush=True)
        return passed

    def summary(self) -> dict[str, int]:
        passed = sum(case.passed for case in self.cases)
        return {"cases": len(self.cases), "passed": passed, "failed": len(self.cases) - passed}


# --- HTTP ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Expect:
    """What an answer must be: one of ``statuses``; its error message containing each of ``mentions``
    (case-insensitive) and matching each of ``patterns``; with ``openai_param``, OpenAI's error shape naming it."""

    statuses: tuple[int, ...]
    mentions: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    openai_param: str | None = None

    def describe(self) -> str:
        parts = [f"status {' or '.join(map(str, self.statuses))}"]
        parts += [f"message names {m!r}" for m in self.mentions]
        parts += [f"message matches /{p}/" for p in self.patterns]
        if self.openai_param:
            parts.append(f"OpenAI error shape with param {self.openai_param!r}")
        return "; ".join(parts + ["never 500, no Traceback"])

    def met(self, status: int, text: str) -> bool:
        message = error_message(text)
        return (
            status in self.statuses
            and all(m.lower() in message.lower() for m in self.mentions)
            and all(re.search(p, message, re.I) for p in self.patterns)
            and (self.openai_param is None or openai_param(text) == self.openai_param)
        )


def error_message(text: str) -> str:
    """``{"error": "..."}`` or OpenAI's ``{"error": {"message": "..."}}``: the message; else the whole body."""
    try:
        body = json.loads(text)
    except ValueError:
        return text
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", text))
    return error if isinstance(error, str) else text


def openai_param(text: str) -> str | None:
    try:
        error = json.loads(text)["error"]
        return error["param"] if {"message", "type", "param"} <= set(error) else None
    except (ValueError, KeyError, TypeError):
        return None


def sane(status: int, text: str) -> bool:
    """What every answer must be, whatever the case: not a 500, no traceback."""
    return status != 500 and "traceback" not in text.lower()


def http_case(
    report: Report, http: httpx.Client, name: str, method: str, path: str, body: Any, expect: Expect, headers: dict[str, str] | None = None
) -> httpx.Response | None:
    """Send ``body`` (a dict: JSON; bytes or str: as is; None: no body) and record the answer against ``expect``."""
    kwargs: dict[str, Any] = {"headers": headers or {}}
    if isinstance(body, (bytes, str)):
        kwargs["content"] = body
        kwargs["headers"] = {"Content-Type": "application/json", **kwargs["headers"]}
    elif body is not None:
        kwargs["content"] = json.dumps(body)  # json.dumps writes NaN as the literal the issue sends
        kwargs["headers"] = {"Content-Type": "application/json", **kwargs["headers"]}
    shown = body if isinstance(body, str) else body.decode(errors="replace") if isinstance(body, bytes) else json.dumps(body)
    sent = f"{method} {path}" + (f" {shown[:200]}" if body is not None else "")
    started = time.perf_counter()
    try:
        response = http.request(method, path, **kwargs)
    except httpx.HTTPError as error:
        report.add(name, sent, expect.describe(), {"error": f"{type(error).__name__}: {error}"}, False)
        return None
    seconds = round(time.perf_counter() - started, 3)
    observed = {"status": response.status_code, "body": response.text[:300], "seconds": seconds}
    report.add(
        name,
        sent,
        expect.describe(),
        observed,
        sane(response.status_code, response.text) and expect.met(response.status_code, response.text),
    )
    return response


def raw_http(port: int, request: bytes, timeout_s: float = 30.0) -> tuple[int, str]:
    """One request written as bytes (headers httpx would not send, such as a Content-Length larger than the body)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(request)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            head, _, rest = b"".join(chunks).partition(b"\r\n\r\n")
            length = re.search(rb"content-length:\s*(\d+)", head, re.I)
            if length and len(rest) >= int(length.group(1)):
                break
    head, _, rest = b"".join(chunks).partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/") else 0
    return status, rest.decode(errors="replace")


def metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The sum of a Prometheus sample ``name`` over the series whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in (labels or {}).items()):
            total += float(match.group(2))
    return total


def cancel_counts(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {
        "cancelled_disconnect": metric(text, "ldlm_request_cancelled_total", {"model": "generate", "reason": "disconnect"}),
        "cancelled_samples": metric(text, "ldlm_cancelled_samples_total", {"model": "generate"}),
        "refused": metric(text, "ldlm_request_refused_total", {"model": "generate"}),
    }


# --- 2. a plain server -----------------------------------------------------------------------------


def abandoned(report: Report, http: httpx.Client, big: dict[str, Any]) -> None:
    """A client gives up on ``big`` after 1 s (curl -m 1); the next small request must come back fast, and
    /metrics must count the abandoned work (cancelled when admitted; refused when refused up front)."""
    before = cancel_counts(http)
    started = time.perf_counter()
    try:
        response = http.post("/v1/generate", json=big, timeout=1)
        outcome: int | str = response.status_code
        text = response.text
    except httpx.TimeoutException:
        outcome, text = "client gave up after 1 s", ""
    big_s = time.perf_counter() - started
    started = time.perf_counter()
    small = http.post("/v1/generate", json=SMALL_GENERATION, timeout=120)
    small_s = time.perf_counter() - started
    gave_up = isinstance(outcome, str)
    deadline = time.monotonic() + 5.0  # the scheduler drops cancelled samples at its next step
    while True:
        after = cancel_counts(http)
        delta = {k: after[k] - before[k] for k in after}
        counted = (delta["cancelled_disconnect"] >= 1 and delta["cancelled_samples"] >= big["n"]) if gave_up else delta["refused"] >= 1
        if counted or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    observed = {
        "big": outcome,
        "big_body": text[:300],
        "big_seconds": round(big_s, 2),
        "small_status": small.status_code,
        "small_seconds": round(small_s, 3),
        "metrics_delta": delta,
    }
    refused_ok = outcome in (413, 503) and sane(int(outcome), text)
    passed = (gave_up or refused_ok) and small.status_code == 200 and small_s < SMALL_AFTER_ABANDONED_S and counted
    report.add(
        f"abandoned {big['n']}x{big['length']}x{big['steps']}, then a small generation",
        f"POST /v1/generate {json.dumps(big)} (client gives up after 1 s), then {json.dumps(SMALL_GENERATION)}",
        f"the big one given up on or refused (413/503); the small one 200 in < {SMALL_AFTER_ABANDONED_S:g} s; /metrics "
        "counts it: cancelled (disconnect) with its n samples when admitted, refused when refused",
        observed,
        passed,
    )


def streamed_previews(report: Report, http: httpx.Client) -> None:
    body = {"n": 1, "length": 16, "steps": 40, "stream": True, "preview_every": 5}
    started = time.perf_counter()
    with http.stream("POST", "/v1/generate", json=body) as response:
        lines = list(response.iter_lines())
        status, kind = response.status_code, response.headers.get("content-type", "")
    seconds = round(time.perf_counter() - started, 3)
    events = sse_events(lines)
    names = [name for name, _ in events]
    steps = [sample["step"] for name, data in events if name == "preview" for sample in data.get("samples", [])]
    result = events[-1][1] if events and events[-1][0] == "result" else {}
    observed = {
        "status": status,
        "content_type": kind,
        "events": names,
        "preview_steps": steps,
        "seconds": seconds,
        "result_texts": len(result.get("texts", [])),
        "body": "\n".join(lines)[:300],
    }
    passed = (
        status == 200
        and kind.startswith("text/event-stream")
        and names == ["preview"] * 7 + ["result"]
        and steps == [5, 10, 15, 20, 25, 30, 35]
        and len(result.get("texts", [])) == 1
        and "traceback" not in "".join(lines).lower()
    )
    report.add(
        "streamed previews on an idle server",
        f"POST /v1/generate {json.dumps(body)}",
        "200 text/event-stream: 7 preview events (steps 5, 10, ..., 35), then one result event with 1 text",
        observed,
        passed,
    )


class LongStream(threading.Thread):
    """A long streamed generation read until ``stop`` is set; then the client goes away."""

    def __init__(self, url: str, body: dict[str, Any], stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.stop = url, body, stop
        self.running, self.finished = threading.Event(), threading.Event()
        self.previews, self.status, self.error = 0, 0, ""

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=120) as http, http.stream("POST", "/v1/generate", json=self.body) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("event: preview"):
                        self.previews += 1
                        self.running.set()
                    elif line.startswith("event: "):
                        self.error = line if line != "event: result" else ""
                        break
                    if self.stop.is_set():
                        return  # leaving the block closes the connection: the server cancels the request
                if response.status_code != 200:
                    self.error = response.read().decode(errors="replace")[:300]
        except httpx.HTTPError as error:
            self.error = f"{type(error).__name__}: {error}"
        finally:
            self.finished.set()
            self.running.set()


def short_beside_long(report: Report, url: str, http: httpx.Client, clients: int = 3) -> None:
    """Long streamed generations run; a 6-step request must not wait for them to finish."""
    long_body = {"n": 4, "length": 64, "steps": 1000, "seed": 0, "sampler": "ddim", "stream": True, "preview_every": 10}
    short = {"n": 1, "length": 16, "steps": 6, "seed": 1}
    stop = threading.Event()
    streams = [LongStream(url, {**long_body, "seed": i}, stop) for i in range(clients)]
    for stream in streams:
        stream.start()
    for stream in streams:
        stream.running.wait(60)
    started = time.perf_counter()
    response = http.post("/v1/generate", json=short, timeout=120)
    seconds = time.perf_counter() - started
    still_running = sum(not s.finished.is_set() for s in streams)
    stop.set()
    for stream in streams:
        stream.join(30)
    observed = {
        "short_status": response.status_code,
        "short_body": response.text[:300],
        "short_seconds": round(seconds, 3),
        "long_running_when_short_answered": still_running,
        "long_previews": [s.previews for s in streams],
        "long_status": [s.status for s in streams],
        "long_errors": [s.error for s in streams if s.error],
    }
    passed = (
        response.status_code == 200
        and seconds < SHORT_BESIDE_LONG_S
        # at least one long stream still running when the short one is answered: it did not wait for them.
        # (Not all: the previews that mark a stream as running arrive late while others wait, by design,
        # and by then a long stream may have finished.)
        and still_running >= 1
        and sane(response.status_code, response.text)
    )
    report.add(
        f"short request beside {clients} long streamed ones",
        f"{clients} x POST /v1/generate {json.dumps(long_body)} (running), then POST /v1/generate {json.dumps(short)}",
        f"the short one 200 in < {SHORT_BESIDE_LONG_S:g} s while long ones still run",
        observed,
        passed,
    )


def stop_points(text: str) -> tuple[str, str, str, str]:
    """Two stop texts for a completion ``text``, and what is left before each: one inside it, after
    some words (its first occurrence), and one at its very start (only spaces, or nothing, left)."""
    start = len(text) - len(text.lstrip())
    inside = next((i for i in range(start + 1, len(text)) if not text[i].isspace() and text.find(text[i]) == i), -1)
    at_start = text[start : start + 3]
    return (text[inside] if inside > 0 else "", text[:inside] if inside > 0 else "", at_start, text[:start])


def openai_stop_and_echo(report: Report, http: httpx.Client) -> None:
    """``stop`` and ``echo`` are implemented: compared with the same completion without them (ddim, one seed)."""
    base = {"model": "ldlm", "prompt": "Hello", "max_tokens": 12, "steps": 4, "seed": 7, "sampler": "ddim"}
    plain = http.post("/v1/completions", json=base)
    text = plain.json()["choices"][0]["text"] if plain.status_code == 200 else ""
    stop_inside, before_inside, stop_at_start, before_start = stop_points(text)
    cases = [
        ("stop inside the completion", {**base, "stop": [stop_inside]}, before_inside, "stop"),
        ("echo", {**base, "echo": True}, "Hello" + text, None),
        ("stop and echo", {**base, "stop": stop_inside, "echo": True}, "Hello" + before_inside, "stop"),
        ("stop at the completion's first word", {**base, "stop": [stop_at_start]}, before_start, "stop"),
    ]
    for label, body, want, reason in cases:
        response = http.post("/v1/completions", json=body)
        choice = response.json().get("choices", [{}])[0] if response.status_code == 200 else {}
        got = choice.get("text")
        # before the first word there are only spaces: an answer without them is as good
        text_ok = got == want if want.strip() else isinstance(got, str) and not got.strip()
        observed = {"status": response.status_code, "body": response.text[:300], "without_stop_or_echo": text}
        passed = (
            bool(stop_inside and stop_at_start)
            and response.status_code == 200
            and text_ok
            and (reason is None or choice.get("finish_reason") == reason)
        )
        report.add(
            f"/v1/completions {label} works",
            f"POST /v1/completions {json.dumps(body)}",
            f"200; choices[0].text == {want!r}{'' if want.strip() else ' (or only spaces)'} (without stop and echo: {text!r})"
            + (f"; finish_reason {reason!r}" if reason else ""),
            observed,
            passed,
        )


def texts_empty_alike(report: Report, http: httpx.Client) -> None:
    for path in ("/v1/reconstruct", "/v1/encode"):
        none, empty = http.post(path, json={"texts": []}), http.post(path, json={"texts": [""]})
        observed = {"texts_[]": [none.status_code, none.text[:150]], 'texts_[""]': [empty.status_code, empty.text[:150]]}
        passed = (
            none.status_code == empty.status_code
            and 400 <= none.status_code < 500
            and sane(none.status_code, none.text)
            and sane(empty.status_code, empty.text)
        )
        report.add(
            f'{path}: texts [] and [""] answered alike',
            f'POST {path} {{"texts": []}} and {{"texts": [""]}}',
            "the same 4xx status for both",
            observed,
            passed,
        )


# (name, method, path, body, expected), and optionally the request's extra headers
HttpCaseSpec = tuple[str, str, str, Any, Expect] | tuple[str, str, str, Any, Expect, dict[str, str]]


def loose_input_cases() -> list[HttpCaseSpec]:
    """Loose input and messages: refused, naming the field, the value and the range."""
    small = {"n": 1, "length": 8, "steps": 2}
    completion = {"model": "ldlm", "prompt": "Hello", "max_tokens": 8, "steps": 2}
    return [
        ("boolean for an integer", "POST", "/v1/generate", {"n": True}, Expect((422,), ("n", "true"))),
        ("misspelled field", "POST", "/v1/generate", {**small, "lenght": 8}, Expect((422,), ("lenght",))),
        ("unknown field", "POST", "/v1/generate", {**small, "temperature": 0.5}, Expect((422,), ("temperature",))),
        ("field in the wrong case", "POST", "/v1/generate", {**small, "Stream": True}, Expect((422,), ("Stream",))),
        ("unknown field in /v1/reconstruct", "POST", "/v1/reconstruct", {"texts": ["a"], "txt": ["b"]}, Expect((422,), ("txt",))),
        ("unknown field in /v1/encode", "POST", "/v1/encode", {"texts": ["a"], "normalize": True}, Expect((422,), ("normalize",))),
        (
            "completions: misspelled field",
            "POST",
            "/v1/completions",
            {**completion, "max_token": 8},
            Expect((400,), ("max_token",), openai_param="max_token"),
        ),
        (
            "completions: unknown field in stream_options",
            "POST",
            "/v1/completions",
            {**completion, "stream": True, "stream_options": {"include_usage": True, "include_usgae": True}},
            Expect((400,), ("include_usgae",)),
        ),
        (
            "completions: logprobs out of range",
            "POST",
            "/v1/completions",
            {**completion, "logprobs": 6},
            Expect((400,), ("logprobs",), openai_param="logprobs"),
        ),
        (
            "completions: best_of",
            "POST",
            "/v1/completions",
            {**completion, "best_of": 2},
            Expect((400,), ("best_of",), openai_param="best_of"),
        ),
        (
            "completions: temperature out of range",
            "POST",
            "/v1/completions",
            {**completion, "temperature": 2.5},
            Expect((400,), ("temperature",), openai_param="temperature"),
        ),
        (
            "seed 1e30: value and range named",
            "POST",
            "/v1/generate",
            {**small, "seed": 1e30},
            Expect((422,), ("seed", MAX_SEED_TEXT), (r"1e\+?30|1000000000000000000000000000000",)),
        ),
        (
            "t_min 5: value and range named",
            "POST",
            "/v1/generate",
            {**small, "t_min": 5},
            Expect((422,), ("t_min",), (r"(?<![\d.])5(?![\d.])", OPEN_UNIT_RANGE)),
        ),
        (
            "reconstruct a too-long text: the text and its token count named",
            "POST",
            "/v1/reconstruct",
            {"texts": [LONG_TEXT]},
            Expect((400, 413, 422), (), (TEXT_NAMED, rf"(?<!\d){LONG_TEXT_TOKENS}(?!\d)")),
        ),
    ]


def deep_json(levels: int) -> str:
    return "[" * levels + "]" * levels


def more_v1_cases() -> list[HttpCaseSpec]:
    """Our own cases of the same kind on the text API: each a 4xx whose message names the problem, never a 500."""
    return [
        ("non-JSON body", "POST", "/v1/generate", "n=1&length=8", Expect((400, 422), ("json",))),
        ("a JSON array for the body", "POST", "/v1/generate", [1, 2], Expect((400, 422))),
        ("negative length", "POST", "/v1/generate", {"n": 1, "length": -3, "steps": 2}, Expect((422,), ("length", "-3"))),
        ("n above its cap", "POST", "/v1/generate", {"n": 65, "length": 8, "steps": 2}, Expect((422,), ("65", "64"))),
        ("unknown sampler", "POST", "/v1/generate", {"n": 1, "length": 8, "steps": 2, "sampler": "euler"}, Expect((422,), ("euler",))),
        ("lone surrogate in a text", "POST", "/v1/reconstruct", '{"texts": ["a\\ud800b"]}', Expect((400, 422), ("texts[0]",))),
        ("/v1 body not UTF-8", "POST", "/v1/reconstruct", b'{"texts": ["\xff\xfe"]}', Expect((400, 422), (), (UTF8_NAMED,))),
        (
            "/v1/generate: JSON nested deeper than allowed",
            "POST",
            "/v1/generate",
            deep_json(100000),
            Expect((400, 413, 422), (), (r"nest|deep",)),
        ),
        (
            "completions: unknown model",
            "POST",
            "/v1/completions",
            {"model": "gpt-4", "prompt": "Hi", "max_tokens": 4},
            Expect((404,), ("gpt-4",), openai_param="model"),
        ),
        ("unknown route", "GET", "/v3/nothing", None, Expect((404,), ("/v3/nothing",))),
        ("wrong method on /v1/generate", "GET", "/v1/generate", None, Expect((405,), ("method",))),
    ]


def more_kserve_cases(encoder: dict[str, Any], decoder: dict[str, Any]) -> list[HttpCaseSpec]:
    """Our own cases of the same kind on KServe v2 infer: each a 4xx whose message names the problem, never a 500."""
    ids, mask = encoder["inputs"]
    nan = {"inputs": [{**decoder["inputs"][0], "data": [math.nan] + decoder["inputs"][0]["data"][1:]}, decoder["inputs"][1]]}
    return [
        ("KServe body not UTF-8", "POST", "/v2/models/encoder/infer", b'{"inputs": ["\xff\xfe"]}', Expect((400,), (), (UTF8_NAMED,))),
        ("KServe: JSON nested deeper than allowed", "POST", "/v2/models/encoder/infer", deep_json(100000), Expect((400, 413), ("nest",))),
        (
            "KServe: data nested deeper than the shape",
            "POST",
            "/v2/models/encoder/infer",
            {"inputs": [{**ids, "shape": [1, 1], "data": json.loads("[" * 20 + "1" + "]" * 20)}]},
            Expect((400,), ("nest",)),
        ),
        ("KServe: NaN in a tensor", "POST", "/v2/models/decoder/infer", nan, Expect((400,), ("nan",))),
        (
            "KServe: wrong datatype",
            "POST",
            "/v2/models/encoder/infer",
            {"inputs": [{**ids, "datatype": "FP32"}, mask]},
            Expect((400,), ("FP32", "INT64")),
        ),
        (
            "KServe: unknown datatype",
            "POST",
            "/v2/models/encoder/infer",
            {"inputs": [{**ids, "datatype": "STRING"}, mask]},
            Expect((400,), ("STRING",)),
        ),
        (
            "KServe: token id outside the vocabulary",
            "POST",
            "/v2/models/encoder/infer",
            {"inputs": [{**ids, "data": [60000] * len(ids["data"])}, mask]},
            Expect((400,), ("60000",)),
        ),
        (
            "KServe: attention_mask of 2",
            "POST",
            "/v2/models/encoder/infer",
            {"inputs": [ids, {**mask, "data": [2] * len(mask["data"])}]},
            Expect((400,), ("attention_mask", "2")),
        ),
        (
            "KServe: misspelled top-level field",
            "POST",
            "/v2/models/encoder/infer",
            {**encoder, "outptus": [{"name": "latents"}]},
            Expect((400, 422), ("outptus",)),
        ),
        (
            "KServe: misspelled field in an input",
            "POST",
            "/v2/models/encoder/infer",
            {"inputs": [{**ids, "paramters": {"binary_data": True}}, mask]},
            Expect((400, 422), ("paramters",)),
        ),
        (
            "KServe: unsupported Content-Encoding",
            "POST",
            "/v2/models/encoder/infer",
            json.dumps(encoder),
            Expect((400, 415), ("br",)),
            {"Content-Encoding": "br"},
        ),
        ("KServe: unknown model (infer)", "POST", "/v2/models/nope/infer", encoder, Expect((404,), ("nope",))),
        ("KServe: unknown model (metadata)", "GET", "/v2/models/nope", None, Expect((404,), ("nope",))),
        ("wrong method on a KServe infer", "DELETE", "/v2/models/encoder/infer", None, Expect((405,), ("method",))),
    ]


def run_http_cases(report: Report, http: httpx.Client, cases: list[HttpCaseSpec]) -> None:
    for name, method, path, body, expect, *headers in cases:
        http_case(report, http, name, method, path, body, expect, headers[0] if headers else None)


def huge_content_length(report: Report, port: int) -> None:
    request = (
        b"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 99999999999\r\nConnection: close\r\n\r\n{}"
    )
    started = time.perf_counter()
    status, body = raw_http(port, request)
    expect = Expect((413,), ("99999999999",))
    observed = {"status": status, "body": body[:300], "seconds": round(time.perf_counter() - started, 3)}
    report.add(
        "huge Content-Length",
        "POST /v1/generate with Content-Length: 99999999999 and a 2-byte body",
        expect.describe(),
        observed,
        sane(status, body) and expect.met(status, body),
    )


# --- 3. a server with LDLM_API_KEY -------------------------------------------------------------------


def api_routes(encoder: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """Every route that runs the model or tells about it, with a body it answers 200 to."""
    return [
        ("POST", "/v1/generate", SMALL_GENERATION),
        ("POST", "/v1/reconstruct", {"texts": ["hello"]}),
        ("POST", "/v1/encode", {"texts": ["hello"]}),
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"model": "ldlm", "prompt": "Hi", "max_tokens": 4, "steps": 2}),
        ("GET", "/v2", None),
        ("GET", "/v2/models/encoder", None),
        ("GET", "/v2/models/encoder/ready", None),
        ("POST", "/v2/models/encoder/infer", encoder),
        ("GET", "/metrics", None),
    ]


def api_key_cases(report: Report, http: httpx.Client, key: str, encoder: dict[str, Any]) -> None:
    for path in ("/", "/docs", "/openapi.json"):
        http_case(report, http, f"key set: {path} open without it", "GET", path, None, Expect((200,)))
    for method, path, body in api_routes(encoder):
        http_case(report, http, f"key set: {method} {path} without it", method, path, body, Expect((401,)))
        http_case(
            report,
            http,
            f"key set: {method} {path} with a wrong one",
            method,
            path,
            body,
            Expect((401,)),
            {"Authorization": f"Bearer {key}x"},
        )
        http_case(report, http, f"key set: {method} {path} with it", method, path, body, Expect((200,)), {"Authorization": f"Bearer {key}"})


# --- 1. the CLI ----------------------------------------------------------------------------------------


@dataclass
class CliRun:
    code: int
    stdout: str
    stderr: str
    seconds: float
    max_rss_mb: float

    def observed(self) -> dict[str, Any]:
        lines = [line for line in self.stderr.splitlines() if line.strip()]
        error = next((line for line in lines if "error" in line.lower()), lines[-1] if lines else "")
        return {
            "exit": self.code,
            "stderr_line": error[:300],
            "stderr_lines": len(lines),
            "stdout": self.stdout[-300:],
            "seconds": round(self.seconds, 2),
            "max_rss_mb": round(self.max_rss_mb, 1),
        }


def run_cli(args: list[str], cwd: Path, timeout_s: float = 300.0) -> CliRun:
    """``python -P -m ldlm.cli ARGS`` with its exit code, output, wall time and peak memory (from wait4)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-P", "-m", "ldlm.cli", *args], stdout=out, stderr=err, cwd=cwd)
        timer = threading.Timer(timeout_s, process.kill)
        timer.start()
        _, status, usage = os.wait4(process.pid, 0)
        timer.cancel()
        seconds = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
        out.seek(0)
        err.seek(0)
        return CliRun(
            process.returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"), seconds, usage.ru_maxrss / 1024
        )


@dataclass(frozen=True)
class CliExpect:
    """An exit code in ``codes``; the error line (stderr) naming each of ``mentions`` and matching ``patterns``;
    none of ``forbidden`` anywhere in the output; within ``max_s`` and ``max_rss_mb``."""

    codes: tuple[int, ...]
    mentions: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()
    forbidden: tuple[str, ...] = ()
    max_s: float | None = None
    max_rss_mb: float | None = None

    def describe(self) -> str:
        parts = [f"exit {' or '.join(map(str, self.codes))}"] + [f"stderr names {m!r}" for m in self.mentions]
        parts += [f"stderr matches /{p}/" for p in self.patterns] + [f"no {f!r} in the output" for f in self.forbidden]
        parts += [f"within {self.max_s:g} s"] if self.max_s else []
        parts += [f"peak memory < {self.max_rss_mb:g} MB"] if self.max_rss_mb else []
        return "; ".join(parts + ["no Traceback"])

    def met(self, run: CliRun) -> bool:
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()] or lines
        named = (
            any(
                all(m.lower() in line.lower() for m in self.mentions) and all(re.search(p, line, re.I) for p in self.patterns)
                for line in errors
            )
            if self.mentions or self.patterns
            else True
        )
        output = run.stdout + run.stderr
        return (
            run.code in self.codes
            and named
            and not any(f.lower() in output.lower() for f in self.forbidden)
            and (self.max_s is None or run.seconds < self.max_s)
            and (self.max_rss_mb is None or run.max_rss_mb < self.max_rss_mb)
        )


def cli_case(report: Report, name: str, args: list[str], expect: CliExpect, cwd: Path) -> CliRun:
    run = run_cli(args, cwd)
    report.add(
        name,
        "ldlm " + " ".join(a if len(a) < 60 else f"{a[:40]}...({len(a)} chars)" for a in args),
        expect.describe(),
        run.observed(),
        "traceback" not in run.stderr.lower() and expect.met(run),
    )
    return run


def refused_fast(mentions: tuple[str, ...], patterns: tuple[str, ...] = ()) -> CliExpect:
    """Exit 1 or 2 within CLI_CAP_S, the error line naming ``mentions``, no big allocation."""
    return CliExpect((1, 2), mentions, patterns, max_s=CLI_CAP_S, max_rss_mb=CLI_CAP_RSS_MB)


def cap_cases(ckpt: str) -> list[tuple[str, list[str], CliExpect]]:
    """Caps: refused fast, with one error line naming the value and the allowed range, nothing big allocated."""
    return [
        (
            "generate --steps 1000000000",
            ["generate", ckpt, "--steps", "1000000000"],
            refused_fast(("1000000000",), (r"(?<!\d)1000(?!\d)",)),
        ),
        (
            "generate --n 1000000000",
            ["generate", ckpt, "--n", "1000000000"],
            refused_fast(("1000000000",), (r"(?<!\d)64(?!\d)",)),
        ),
        ("generate --seed -1", ["generate", ckpt, "--seed", "-1"], refused_fast(("-1", MAX_SEED_TEXT))),
        (
            "generate --length 1000 (max_seq_len 128)",
            ["generate", ckpt, "--length", "1000"],
            refused_fast(("1000",), (r"(?<!\d)128(?!\d)",)),
        ),
        ("generate --length 0", ["generate", ckpt, "--length", "0"], refused_fast(("0",), (r"length|>= ?1|1\.\.",))),
        ("generate --t-min 5", ["generate", ckpt, "--t-min", "5"], refused_fast(("5",), (OPEN_UNIT_RANGE,))),
        ("generate --steps abc", ["generate", ckpt, "--steps", "abc"], refused_fast(("abc",))),
    ]


def message_cases(work: Path, ckpt: str, onnx: str) -> list[tuple[str, list[str], CliExpect]]:
    no_overwrite = ("overwrite=True",)
    return [
        (
            "init /proc/nope names the user's path",
            ["init", "/proc/nope", "--preset", "tiny", "--quiet"],
            CliExpect((1, 2), ("/proc/nope",), (rf"^(?!.*({TEMP_NAME}))",)),
        ),
        (
            "init --seed -5 refused like generate --seed -1",
            ["init", str(work / "seeded"), "--seed", "-5"],
            refused_fast(("-5", MAX_SEED_TEXT)),
        ),
        (
            "init over an existing checkpoint: no overwrite=True",
            ["init", ckpt, "--quiet"],
            CliExpect((1, 2), (ckpt, "--force"), forbidden=no_overwrite),
        ),
        (
            "export over an existing directory: no overwrite=True",
            ["export", ckpt, onnx, "--quiet"],
            CliExpect((1, 2), (onnx, "--force"), forbidden=no_overwrite),
        ),
        (
            "triton-repo over an existing directory: no overwrite=True",
            ["triton-repo", onnx, ckpt, "--cpu"],
            CliExpect((1, 2), (ckpt, "--force"), forbidden=no_overwrite),
        ),
        (
            "reconstruct a too-long text: the text and its token count named",
            ["reconstruct", ckpt, LONG_TEXT],
            CliExpect((1, 2), (), (TEXT_NAMED, rf"(?<!\d){LONG_TEXT_TOKENS}(?!\d)")),
        ),
        (
            "triton-repo --cpu: no docker run --gpus all hint",
            ["triton-repo", onnx, str(work / "triton-cpu"), "--cpu"],
            CliExpect((0,), forbidden=("--gpus all",)),
        ),
    ]


PYTHON_RECONSTRUCT = """import sys
from ldlm.pipeline import LDLMPipeline
pipe = LDLMPipeline.from_checkpoint(sys.argv[1])
try:
    result = pipe.reconstruct("hello")
except (TypeError, ValueError) as error:
    print("refused:", type(error).__name__, error)
else:
    print("texts:", len(result.texts))
"""


def python_reconstruct_string(report: Report, ckpt: str, cwd: Path) -> None:
    """The Python API: ``pipe.reconstruct("hello")`` is one text or a refusal, never 5 one-letter texts."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-P", "-c", PYTHON_RECONSTRUCT, ckpt], capture_output=True, text=True, cwd=cwd, timeout=300)
    out = done.stdout.strip()
    observed = {
        "exit": done.returncode,
        "stdout": out[:300],
        "stderr": done.stderr[-300:],
        "seconds": round(time.perf_counter() - started, 2),
    }
    passed = done.returncode == 0 and (out == "texts: 1" or (out.startswith("refused:") and "hello" in out))
    report.add(
        'Python API pipe.reconstruct("hello")',
        'LDLMPipeline.from_checkpoint(CKPT).reconstruct("hello")',
        "one text, or a TypeError/ValueError naming the string; never 5 texts",
        observed,
        passed,
    )


def cli_cases(report: Report, work: Path) -> tuple[str, str]:
    """Make the tiny checkpoint and its export with the CLI, then the CLI cases; the two paths for the servers."""
    ckpt, onnx = str(work / "ckpt"), str(work / "onnx")
    made = cli_case(report, "init a tiny checkpoint", ["init", ckpt, "--preset", "tiny", "--quiet"], CliExpect((0,)), work)
    exported = cli_case(report, "export it", ["export", ckpt, onnx, "--quiet"], CliExpect((0,)), work)
    if made.code or exported.code:
        raise RuntimeError(
            f"setup failed: init exit {made.code}, export exit {exported.code}: {made.stderr[-500:]}{exported.stderr[-500:]}"
        )
    for name, args, expect in cap_cases(ckpt) + message_cases(work, ckpt, onnx):
        cli_case(report, name, args, expect, work)
    python_reconstruct_string(report, ckpt, work)
    return ckpt, onnx


# --- main --------------------------------------------------------------------------------------------


def with_server(report: Report, onnx: str, work: Path, name: str, env: dict[str, str], cases: Callable[[str, int], None]) -> None:
    """``ldlm serve ONNX`` on a free loopback port with ``env``; ``cases(url, port)``; then a clean stop (recorded)."""
    port = free_port()
    log_path = work / f"{name}.log"
    with log_path.open("w") as log:
        server = start_server(onnx, port, ["--threads", "1", "--log-level", "warning"], log=log, log_path=log_path, env=env)
        try:
            cases(f"http://127.0.0.1:{port}", port)
        finally:
            exit_code = stop_server(server)
    server_log = log_path.read_text(errors="replace")
    report.add(
        f"{name}: stopped cleanly, no traceback in its log",
        f"SIGTERM to ldlm serve ({name})",
        "exit 0; no Traceback in its output",
        {"exit": exit_code, "log_tail": server_log[-300:]},
        exit_code == 0 and "traceback" not in server_log.lower(),
    )


def plain_server_cases(report: Report, url: str, port: int) -> None:
    from scripts.harness.traffic import decoder_body, encoder_body, latent_width

    with httpx.Client(base_url=url, timeout=60) as http:
        abandoned(report, http, {"n": 64, "length": 128, "steps": 1000})  # the request, on a fresh server
        abandoned(report, http, {"n": 2, "length": 64, "steps": 1000, "seed": 1})  # small enough to be admitted
        streamed_previews(report, http)
        short_beside_long(report, url, http)
        run_http_cases(report, http, loose_input_cases())
        openai_stop_and_echo(report, http)
        texts_empty_alike(report, http)
        run_http_cases(report, http, more_v1_cases())
        run_http_cases(report, http, more_kserve_cases(encoder_body(4, 0), decoder_body(2, latent_width(url), 0)))
        huge_content_length(report, port)


def section(report: Report, name: str, run: Callable[[], Any]) -> None:
    """Run one group of cases; a crash of the group (the server did not start, the client broke) is a failed case."""
    try:
        run()
    except Exception as error:
        report.add(f"{name}: ran to the end", name, "the group runs to its end", {"error": f"{type(error).__name__}: {error}"[:300]}, False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="JSON report to write (atomically)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder (checkpoint, export, server logs)")
    args = parser.parse_args()
    report = Report()
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="ldlm-replay-"))
    key = os.urandom(12).hex()
    plain_env = {k: v for k, v in os.environ.items() if k != "LDLM_API_KEY"}
    onnx = str(work / "onnx")

    def keyed_cases(url: str, port: int) -> None:
        from scripts.harness.traffic import encoder_body

        with httpx.Client(base_url=url, timeout=60) as http:
            api_key_cases(report, http, key, encoder_body(4, 0))

    try:
        section(report, "CLI", lambda: cli_cases(report, work))
        if Path(onnx, "manifest.json").is_file():
            section(
                report,
                "plain server",
                lambda: with_server(report, onnx, work, "plain server", plain_env, lambda url, port: plain_server_cases(report, url, port)),
            )
            section(
                report,
                "server with LDLM_API_KEY",
                lambda: with_server(report, onnx, work, "server with LDLM_API_KEY", {**plain_env, "LDLM_API_KEY": key}, keyed_cases),
            )
    finally:
        if args.keep:
            print(f"scratch kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    summary = report.summary()
    write_report(
        {
            "summary": summary,
            "seconds": round(time.perf_counter() - started, 1),
            "python": sys.executable,
            "cases": [asdict(case) for case in report.cases],
        },
        str(args.out),
    )
    print(json.dumps(summary), file=sys.stderr)
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
