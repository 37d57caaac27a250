"""One plan per request, whatever the path: for every sampler (and none), with and without t_min and
prior_temperature, on a checkpoint with tuned grids and on one without, ``LDLMPipeline.generate``,
``ldlm generate --json``, /v1/generate (plain and streamed), and /v1/completions through the official
``openai`` client produce the same tokens for the same seed and name the same plan; with a prompt and without a
seed, ldlm serve's KServe model ldlm_generate too.

The tuned checkpoint tunes ddim at 3 steps and dpm3m-psc at 5 (its defaults), so a request naming no
steps gets a different count for those samplers than for the others (the config's default_steps): a
front end that filled in one default of its own for every sampler would fail here."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from ldlm.cli import main
from ldlm.model.checkpoint import WEIGHTS_FILE
from ldlm.model.config import SAMPLERS, LDLMConfig
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling.tuned_grids import TunedGrid, TunedSchedules, weights_sha256
from ldlm.serve.api.service import LDLMService, ServerSettings
from tests.servers import RunningServer, free_port, openai_client

LENGTH, SEED = 6, 11
EXTRAS: tuple[dict[str, float], ...] = ({}, {"t_min": 0.1}, {"prior_temperature": 0.9})
TUNED_DEFAULTS = {"ddim": 3, "dpm3m-psc": 5}


def tuned_copy(checkpoint: Path, out: Path) -> Path:
    """``checkpoint`` with a schedules.json tuning ddim@3 and dpm3m-psc@5 (here: chosen, power-like grids)."""
    shutil.copytree(checkpoint, out)
    t_min = LDLMConfig.load(out / "config.json").t_min
    grids = tuple(
        TunedGrid(sampler, steps, tuple(1.0 - (1.0 - t_min) * (i / steps) ** 0.7 for i in range(steps)) + (t_min,))
        for sampler, steps in TUNED_DEFAULTS.items()
    )
    TunedSchedules(weights_sha256(out / WEIGHTS_FILE), t_min, grids, dict(TUNED_DEFAULTS)).save(out / "schedules.json")
    return out


@pytest.fixture(scope="module", params=["tuned", "untuned"])
def served(
    request: pytest.FixtureRequest, tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Path, RunningServer]]:
    checkpoint = tiny_checkpoint if request.param == "untuned" else tuned_copy(tiny_checkpoint, tmp_path_factory.mktemp("tuned") / "ckpt")
    server = RunningServer(LDLMService(str(checkpoint), ServerSettings(backend="eager", port=free_port())))
    yield checkpoint, server
    server.stop()


def cli_generate(checkpoint: Path, body: dict[str, Any]) -> dict[str, Any]:
    argv = ["generate", str(checkpoint), "--n", "1", "--length", str(LENGTH), "--seed", str(SEED), "--json", "--quiet"]
    for field, value in body.items():
        argv += [f"--{field.replace('_', '-')}", str(value)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    return json.loads(out.getvalue())


def streamed_result(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The ``result`` event of /v1/generate with ``stream: true``, after its previews."""
    with httpx.stream("POST", f"{url}/v1/generate", json={**body, "stream": True, "preview_every": 2}, timeout=60) as response:
        assert response.status_code == 200
        events = response.read().decode().split("\n\n")
    result = [e for e in events if e.startswith("event: result")]
    assert len(result) == 1, events
    return json.loads(result[0].split("data: ", 1)[1])


def kserve_generate(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """/v1/generate's answer from ldlm serve's KServe model ``ldlm_generate``, through tritonclient's HTTP client:
    each field one value of its input in upper case (INT64 and BYTES here: no float is exact in FP32)."""
    import numpy as np
    import tritonclient.http as httpclient

    inputs = []
    for field, value in body.items():
        tensor = httpclient.InferInput(field.upper(), [1], "BYTES" if isinstance(value, str) else "INT64")
        tensor.set_data_from_numpy(
            np.array([value.encode() if isinstance(value, str) else value], dtype=np.object_ if isinstance(value, str) else np.int64)
        )
        inputs.append(tensor)
    with httpclient.InferenceServerClient(url.removeprefix("http://")) as client:
        result = client.infer("ldlm_generate", inputs)
    texts = [text.decode() for text in result.as_numpy("TEXTS")]
    return {"token_ids": result.as_numpy("TOKEN_IDS").tolist(), "texts": texts, "plan": json.loads(result.as_numpy("PLAN")[0])}


@pytest.mark.parametrize("extra", EXTRAS, ids=["defaults", "t_min", "prior_temperature"])
@pytest.mark.parametrize("sampler", [None, *SAMPLERS])
def test_every_path_runs_and_names_the_same_plan(served: tuple[Path, RunningServer], sampler: str | None, extra: dict[str, float]) -> None:
    checkpoint, server = served
    body: dict[str, Any] = {**extra, **({"sampler": sampler} if sampler else {})}
    python = LDLMPipeline.from_checkpoint(str(checkpoint)).generate(
        1, LENGTH, seed=SEED, sampler=sampler, t_min=extra.get("t_min"), prior_temperature=extra.get("prior_temperature")
    )
    assert python.plan is not None
    plan = python.plan.summary()
    runs = {"python": (python.ids(), plan), "cli": cli_generate(checkpoint, body)}
    runs["cli"] = (runs["cli"]["token_ids"], runs["cli"]["plan"])
    plain = httpx.post(f"{server.url}/v1/generate", json={**body, "n": 1, "length": LENGTH, "seed": SEED}, timeout=60)
    assert plain.status_code == 200, plain.text
    runs["http"] = (plain.json()["token_ids"], plain.json()["plan"])
    stream = streamed_result(server.url, {**body, "n": 1, "length": LENGTH, "seed": SEED})
    runs["http stream"] = (stream["token_ids"], stream["plan"])
    with openai_client(server) as client:
        completion = client.completions.create(model="ldlm", prompt="", max_tokens=LENGTH, seed=SEED, extra_body=body)
    for path, (ids, named) in runs.items():
        assert ids == python.ids(), f"{path}: tokens differ from Python's"
        assert named == plan, f"{path}: plan {named} != Python's {plan}"
    # a completion carries text, cut at end-of-text as the pipeline's texts are
    assert completion.choices[0].text == python.texts[0]
    assert completion.model_extra["ldlm_plan"] == plan
    tuned = checkpoint.joinpath("schedules.json").is_file() and not extra
    chosen = sampler or LDLMConfig.load(checkpoint / "config.json").default_sampler
    expected_steps = TUNED_DEFAULTS.get(chosen) if tuned else None
    assert plan["steps"] == (expected_steps or LDLMConfig.load(checkpoint / "config.json").default_steps)
    assert plan["grid"] == ("tuned" if expected_steps else plan["grid"])


def test_a_prompts_strength_reaches_every_path(served: tuple[Path, RunningServer]) -> None:
    """A prompt guided at prompt_strength 4 (two rows per sample and step): the CLI, /v1/generate and
    /v1/completions continue it with Python's tokens and name its strength in the plan; without the strength
    the continuation differs."""
    checkpoint, server = served
    pipeline = LDLMPipeline.from_checkpoint(str(checkpoint))
    prompt, strength = "It is a truth", 4.0
    ids = pipeline.tokenizer.encode([prompt])[0]
    python = pipeline.generate(1, len(ids) + LENGTH, seed=SEED, prompt=prompt, prompt_strength=strength)
    assert python.plan is not None and python.plan.prompt_strength == strength
    after = python.ids()[0][len(ids) :]
    assert after != pipeline.generate(1, len(ids) + LENGTH, seed=SEED, prompt=prompt).ids()[0][len(ids) :]
    argv = ["generate", str(checkpoint), "--n", "1", "--length", str(len(ids) + LENGTH), "--seed", str(SEED)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, "--prompt", prompt, "--prompt-strength", str(strength), "--json", "--quiet"]) == 0
    cli = json.loads(out.getvalue())
    assert (cli["token_ids"], cli["plan"]) == (python.ids(), python.plan.summary())
    body = {"n": 1, "length": len(ids) + LENGTH, "seed": SEED, "prompt": prompt, "prompt_strength": strength}
    http = httpx.post(f"{server.url}/v1/generate", json=body, timeout=60).json()
    assert (http["token_ids"], http["plan"]) == (python.ids(), python.plan.summary())
    with openai_client(server) as client:
        completion = client.completions.create(
            model="ldlm", prompt=prompt, max_tokens=LENGTH, seed=SEED, extra_body={"prompt_strength": strength}
        )
    assert completion.model_extra["ldlm_plan"] == python.plan.summary()
    assert completion.choices[0].text == pipeline.tokenizer.decode(after).split("<|endoftext|>")[0]


PROMPT = "It is a truth"  # 4 GPT-2 tokens


@pytest.mark.parametrize("seeded", [True, False], ids=["seed", "no seed"])
@pytest.mark.parametrize("prompt", ["", PROMPT], ids=["no prompt", "prompt"])
def test_a_prompt_and_a_missing_seed_mean_one_thing_on_every_path(served: tuple[Path, RunningServer], prompt: str, seeded: bool) -> None:
    """``length`` counts the prompt and the answer starts with it verbatim, and a request naming no seed runs
    seed 0, on every path: Python, the CLI, /v1/generate plain and streamed give the same tokens, texts and
    plan; /v1/completions (OpenAI's meaning: max_tokens after the prompt, the text without it) the same
    continuation."""
    checkpoint, server = served
    pipeline = LDLMPipeline.from_checkpoint(str(checkpoint))
    length, seed = LENGTH + 4, ({"seed": SEED} if seeded else {})
    python = pipeline.generate(1, length, prompt=prompt, **seed)
    assert python.plan is not None and python.texts[0].startswith(prompt)
    if not seeded:  # seed 0 is what a request without one runs
        assert python.ids() == pipeline.generate(1, length, seed=0, prompt=prompt).ids()
    expected = (python.ids(), python.texts, python.plan.summary())
    argv = ["generate", str(checkpoint), "--n", "1", "--length", str(length), "--json", "--quiet"]
    argv += ["--seed", str(SEED)] if seeded else []
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*argv, *(["--prompt", prompt] if prompt else [])]) == 0
    cli = json.loads(out.getvalue())
    body = {"n": 1, "length": length, **seed, **({"prompt": prompt} if prompt else {})}
    plain = httpx.post(f"{server.url}/v1/generate", json=body, timeout=60).json()
    stream = streamed_result(server.url, body)
    kserve = kserve_generate(server.url, body)
    for path, answer in (("cli", cli), ("http", plain), ("http stream", stream), ("kserve ldlm_generate", kserve)):
        assert (answer["token_ids"], answer["texts"], answer["plan"]) == expected, f"{path} differs from Python"
    prompt_tokens = len(pipeline.tokenizer.encode([prompt])[0]) if prompt else 0
    with openai_client(server) as client:
        completion = client.completions.create(model="ldlm", prompt=prompt, max_tokens=length - prompt_tokens, **seed)
    assert completion.model_extra["ldlm_plan"] == python.plan.summary()
    assert completion.choices[0].text == python.texts[0][len(prompt) :]


def test_a_prompt_that_leaves_no_room_is_refused_alike_on_every_path(served: tuple[Path, RunningServer]) -> None:
    checkpoint, server = served
    refusal = "the prompt is 4 tokens long; allowed: 1..3 tokens (fewer than length=4)"
    with pytest.raises(ValueError) as python:
        LDLMPipeline.from_checkpoint(str(checkpoint)).generate(1, 4, prompt=PROMPT)
    assert str(python.value) == refusal
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["generate", str(checkpoint), "--length", "4", "--prompt", PROMPT, "--quiet"]) != 0
    assert refusal in err.getvalue()
    http = httpx.post(f"{server.url}/v1/generate", json={"length": 4, "prompt": PROMPT}, timeout=60)
    assert (http.status_code, http.json()["error"]) == (400, refusal)
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as kserve:
        kserve_generate(server.url, {"n": 1, "length": 4, "prompt": PROMPT})
    assert (kserve.value.status(), kserve.value.message()) == ("400", refusal)
