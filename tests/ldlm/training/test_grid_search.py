"""Tuned step grids: the search against a Gaussian oracle's exact ODE solution, schedules.json's checks,
and the tuned grid as every generation's default."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch

from ldlm.cli import main
from ldlm.model.config import preset
from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling import GenerateRequest, NoiseStream, resolve, sample_seeds
from ldlm.sampling.tuned_grids import ScheduleError, TunedGrid, TunedSchedules, load_schedules, weights_sha256
from ldlm.training.grid_search import Tuner, TuningSettings, grid_of, grid_with_scores, logits_of, nelder_mead, tune_grid

MU, S = 0.3, 0.5
CONFIG = preset("tiny")


class OracleGraphs:
    """The ideal denoiser of data x0 ~ N(MU, S^2 I): E[x0 | x_t] = MU + a S^2 (x_t - a MU) / (a^2 S^2 + sigma^2)."""

    def __init__(self, pipeline_schedule) -> None:
        self.schedule = pipeline_schedule

    def denoise(self, x_t, t, x0_prev, mask):
        a, sg = self.schedule.alpha(t)[:, None, None], self.schedule.sigma(t)[:, None, None]
        return MU + a * S**2 * (x_t - a * MU) / (a**2 * S**2 + sg**2)

    def decode_tokens(self, latents, mask):
        return latents.argmax(dim=-1)


def oracle_pipeline() -> LDLMPipeline:
    pipe = LDLMPipeline(OracleGraphs(None), TextTokenizer.gpt2(), config=CONFIG)
    pipe.graphs.schedule = pipe.schedule  # type: ignore[attr-defined]
    return pipe


def exact_error(pipe: LDLMPipeline, times, sampler: str, seed: int, n: int, length: int) -> float:
    """The run's relative distance from the exact solution alpha MU + sqrt(alpha^2 S^2 + sigma^2) x_1."""
    tuner = Tuner(pipe, TuningSettings(sampler))
    x = tuner.latents(seed, n, length, sampler, len(times) - 1, times)
    prior = torch.stack([NoiseStream(s, (length, CONFIG.d_model)).draw() for s in sample_seeds(seed, n)])
    t = torch.tensor(CONFIG.t_min, dtype=torch.float64)
    alpha, sigma = pipe.schedule.alpha(t), pipe.schedule.sigma(t)
    exact = (alpha * MU + torch.sqrt(alpha**2 * S**2 + sigma**2) * prior).float()
    return float((x - exact).norm() / exact.norm())


def test_the_tuned_grid_is_no_worse_than_the_default_one_against_the_exact_solution() -> None:
    """Tuned on some seeds against DDIM@1000, scored on others against the closed form: the searched 4-step
    dpm2m grid's error is at most the power grid's (and clearly below it)."""
    pipe = oracle_pipeline()
    tuner = Tuner(pipe, TuningSettings("dpm2m", (4,), 1000, tune_seed=1, tune_n=2, tune_length=16, held_out_lengths=(16,), evaluations=60))
    grid = tune_grid(tuner, 4)
    power = resolve(GenerateRequest(1, 1, 4, sampler="dpm2m"), CONFIG).times(pipe.schedule).tolist()
    tuned_error, power_error = (exact_error(pipe, times, "dpm2m", seed=7, n=2, length=32) for times in (grid.times, power))
    assert tuned_error <= power_error and tuned_error < 0.9 * power_error, (tuned_error, power_error)
    assert grid.measured["held_out"]["16"]["error"] <= grid.measured["default_grid_held_out"]["16"]["error"]


def test_validation_keeps_the_default_grid_over_a_search_that_fits_only_its_samples() -> None:
    """Of the candidates, the one with the lowest error on the validation seed is kept, whatever the tuning
    samples said: a grid that crowds its steps near t = 1 loses to the default grid, and a better one wins."""
    pipe = oracle_pipeline()
    tuner = Tuner(pipe, TuningSettings("dpm2m", (4,), 400, tune_seed=1, tune_n=2, tune_length=8, held_out_lengths=(8,), validation_seed=5))
    default = tuple(resolve(GenerateRequest(1, 1, 4, sampler="dpm2m"), CONFIG).times(pipe.schedule).tolist())
    crowded = (1.0, 0.99, 0.98, 0.97, CONFIG.t_min)
    grid = grid_with_scores(tuner, 4, {"default": default, "searched": crowded})
    assert grid.times == default and grid.measured["validation"]["kept"] == "default"
    errors = grid.measured["validation"]["errors"]
    assert errors["searched"] > errors["default"]
    exact = {
        name: exact_error(pipe, times, "dpm2m", seed=5, n=2, length=8) for name, times in (("default", default), ("searched", crowded))
    }
    assert exact["searched"] > exact["default"]  # the closed form agrees with the DDIM@400 reference
    assert (5, 2, 8) in tuner.references  # validated on the validation seed's own samples
    tuned = tune_grid(Tuner(pipe, dataclasses.replace(tuner.settings, evaluations=40), tuner.references), 4)
    better = grid_with_scores(tuner, 4, {"default": default, "searched": tuned.times})
    assert better.measured["validation"]["kept"] == "searched" and better.times == tuned.times


def test_the_search_starts_from_the_best_power_grid() -> None:
    """With the budget of the power scan alone, the candidate is the exponent whose grid has the lowest
    search error, and it is a real power grid."""
    from ldlm.sampling.schedule import power_grid
    from ldlm.training.grid_search import POWER_EXPONENTS

    pipe = oracle_pipeline()
    settings = TuningSettings(
        "dpm2m", (4,), 400, tune_seed=1, tune_n=2, tune_length=8, held_out_lengths=(8,), evaluations=len(POWER_EXPONENTS)
    )
    tuner = Tuner(pipe, settings)
    grid = tune_grid(tuner, 4)
    tuning = tuner.samples(1, 2, 8)
    errors = {rho: tuner.search_error(tuning, "dpm2m", 4, tuple(power_grid(4, CONFIG.t_min, rho).tolist())) for rho in POWER_EXPONENTS}
    best = min(errors, key=errors.__getitem__)
    assert f"power {best:g}" in grid.measured["validation"]["errors"]
    assert errors[best] < errors[1.0]  # the scan matters: the exponents differ
    torch.testing.assert_close(power_grid(4, 0.2, 2.0), 0.2 + 0.8 * (1 - torch.linspace(0, 1, 5, dtype=torch.float64)) ** 2)


def test_held_out_scores_are_run_once_per_grid() -> None:
    """DDIM@50's and a default grid's held-out scores are asked for at every step count: each length runs
    once per (sampler, steps, grid), and another grid runs again."""
    tuner = Tuner(oracle_pipeline(), TuningSettings("ddim", reference_steps=200, held_out_n=2, held_out_lengths=(8, 12)))
    for length in (8, 12):
        tuner.samples(tuner.settings.held_out_seed, 2, length)
    runs: list[int] = []
    real = tuner.latents
    tuner.latents = lambda *a: runs.append(1) or real(*a)  # type: ignore[method-assign]
    first = tuner.held_out("ddim", 5, None)
    assert tuner.held_out("ddim", 5, None) == first and len(runs) == 2
    other = tuner.held_out("ddim", 5, (1.0, 0.5, 0.3, 0.2, 0.1, CONFIG.t_min))
    assert len(runs) == 4 and other != first


def test_nelder_mead_finds_the_minimum_of_a_quadratic() -> None:
    import numpy as np

    target = np.array([1.0, -2.0, 0.5])
    x, value = nelder_mead(lambda x: float(((x - target) ** 2).sum()), np.zeros(3), budget=400)
    assert value < 1e-6 and np.allclose(x, target, atol=1e-3)


def test_every_parameter_gives_a_grid_from_one_to_t_min() -> None:
    import numpy as np

    for z in (np.zeros(5), np.array([30.0, -30.0, 0.0, 5.0]), np.random.default_rng(0).normal(size=9) * 10):
        times = grid_of(z, 0.05)
        assert times[0] == 1.0 and times[-1] == 0.05 and len(times) == len(z) + 1
        assert all(b < a for a, b in zip(times, times[1:])) or np.abs(z).max() >= 30  # softmax may round a step to 0
    start = (1.0, 0.7, 0.3, 0.05)
    assert grid_of(logits_of(start), 0.05) == pytest.approx(start)


def schedules(times=(1.0, 0.5, 0.05), steps=2, sha="a" * 64, defaults=None) -> TunedSchedules:
    return TunedSchedules(sha, 0.05, (TunedGrid("ddim", steps, tuple(times)),), {"ddim": steps} if defaults is None else defaults)


@pytest.mark.parametrize(
    ("steps", "times", "message"),
    [
        (3, (1.0, 0.3, 0.5, 0.05), "is not strictly decreasing: times[1]=0.3, times[2]=0.5"),
        (3, (1.0, 0.5, 0.5, 0.05), "is not strictly decreasing: times[1]=0.5, times[2]=0.5"),
        (2, (1.0, 1.5, 0.05), "has the time 1.5; allowed: finite times in [t_min=0.05, 1]"),
        (2, (1.0, 0.01, 0.05), "has the time 0.01"),
        (2, (1.0, math.nan, 0.05), "has the time nan"),
        (2, (1.0, 0.05), "has 2 times; allowed: steps + 1 = 3"),
        (2, (0.9, 0.5, 0.05), "runs from 0.9 to 0.05; allowed: from 1 to t_min=0.05"),
    ],
)
def test_a_grid_edited_by_hand_is_refused_naming_what_is_wrong(steps: int, times, message: str) -> None:
    body = json.loads(schedules().to_json())
    body["grids"][0]["times"], body["grids"][0]["steps"], body["defaults"] = list(times), steps, {}
    with pytest.raises(ScheduleError, match=re.escape(f"the ddim grid of {steps} steps {message}")):
        TunedSchedules.from_json(json.dumps(body))


def test_schedules_of_other_weights_are_refused_naming_both_hashes(tmp_path: Path) -> None:
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"these weights")
    schedules(sha="b" * 64).save(tmp_path / "schedules.json")
    with pytest.raises(ScheduleError, match=f"was tuned on \\(sha256 {weights_sha256(weights)}; tuned on {'b' * 64}\\)"):
        load_schedules(tmp_path, weights=weights)
    schedules(sha=weights_sha256(weights)).save(tmp_path / "schedules.json")
    assert load_schedules(tmp_path, weights=weights) == schedules(sha=weights_sha256(weights))
    (tmp_path / "schedules.json").write_text("{not json")
    with pytest.raises(ScheduleError, match="is not a schedules file"):
        load_schedules(tmp_path)


def test_the_tuned_grid_and_steps_are_the_default_where_tuned() -> None:
    tuned = schedules(times=(1.0, 0.4, 0.05), steps=2)
    plan = resolve(GenerateRequest(1, 4, sampler="ddim"), CONFIG, schedules=tuned)
    assert (plan.steps, plan.grid, plan.tuned_times) == (2, "tuned", (1.0, 0.4, 0.05))
    assert plan.times(None).tolist() == [1.0, 0.4, 0.05]  # type: ignore[arg-type]
    other = resolve(GenerateRequest(1, 4, 3, sampler="ddim"), CONFIG, schedules=tuned)  # 3 steps are not tuned
    assert (other.steps, other.grid) == (3, "uniform")
    assert resolve(GenerateRequest(1, 4, 2, sampler="ddim", grid="power"), CONFIG, schedules=tuned).grid == "power"
    assert resolve(GenerateRequest(1, 4, 2, sampler="ddim", t_min=0.1), CONFIG, schedules=tuned).grid == "uniform"
    assert resolve(GenerateRequest(1, 4, sampler="dpm2m"), CONFIG, schedules=tuned).steps == CONFIG.default_steps
    for request, message in (
        (GenerateRequest(1, 4, 3, sampler="ddim", grid="tuned"), "grid='tuned' has no ddim grid of 3 steps; tuned: [2]"),
        (GenerateRequest(1, 4, 2, sampler="ddim", grid="tuned", t_min=0.1), "grid='tuned' is unavailable at t_min=0.1"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            resolve(request, CONFIG, schedules=tuned)
    with pytest.raises(ValueError, match=re.escape("this checkpoint has no tuned schedules")):
        resolve(GenerateRequest(1, 4, 2, grid="tuned"), CONFIG)


def test_tune_schedule_writes_a_grid_that_generation_then_uses(tiny_checkpoint: Path, tmp_path: Path, capsys) -> None:
    ckpt = tmp_path / "ckpt"
    import shutil

    shutil.copytree(tiny_checkpoint, ckpt)
    args = ["tune-schedule", str(ckpt), "--steps", "3", "--sampler", "ddim", "--evaluations", "6", "--reference-steps", "200", "--force"]
    args += ["--tune-n", "1", "--tune-length", "8", "--held-out-n", "1", "--held-out-lengths", "8", "--quiet", "--json"]
    assert main(args) == 0
    line = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert line["steps"] == 3 and line["times"][0] == 1.0 and set(line["held_out"]) == {"8"}
    pipe = LDLMPipeline.from_checkpoint(ckpt)
    assert pipe.schedules is not None and pipe.schedules.grid("ddim", 3).times == tuple(line["times"])
    tuned = pipe.generate(2, 8, 3, 5, "ddim")
    assert torch.equal(tuned.token_ids, pipe.generate(2, 8, 3, 5, "ddim", grid="tuned").token_ids)
    uniform = pipe.sample_latents(2, 8, 3, 5, "ddim", grid="uniform")
    assert not torch.equal(pipe.sample_latents(2, 8, 3, 5, "ddim"), uniform)
    base = ["generate", str(ckpt), "--n", "2", "--length", "8", "--steps", "3", "--seed", "5", "--sampler", "ddim", "--json", "--quiet"]
    for grid, expected in ((None, tuned), ("uniform", pipe.decode(uniform))):
        assert main(base + (["--grid", grid] if grid else [])) == 0
        assert json.loads(capsys.readouterr().out)["token_ids"] == expected.ids(), grid
    (ckpt / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:-1] + b"\0")  # other weights
    with pytest.raises(ScheduleError, match="do not match the weights .* was tuned on"):
        LDLMPipeline.from_checkpoint(ckpt)


def test_a_device_with_an_onnx_export_is_refused(tiny_checkpoint: Path, export_dir: Path, tmp_path: Path, capsys) -> None:
    args = ["tune-schedule", str(tiny_checkpoint), "--onnx-dir", str(export_dir), "--device", "cuda:0", "--steps", "3", "--quiet"]
    # a tuning this small, written aside, is what would run if the refusal were gone: it would answer 0, at once
    args += ["--sampler", "ddim", "--evaluations", "2", "--reference-steps", "200", "--tune-n", "1", "--tune-length", "8"]
    args += ["--held-out-n", "1", "--held-out-lengths", "8", "--out", str(tmp_path / "schedules.json")]
    assert main(args) == 2
    assert "--device cuda:0 applies to eager PyTorch; --onnx-dir tunes on ONNX Runtime on the CPU" in capsys.readouterr().err


def test_an_interrupted_search_keeps_its_best_grid(tiny_checkpoint: Path, tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C in the middle of the second step count: the first is written whole, the second as far as it got."""
    import shutil

    import ldlm.training.grid_search as tuning

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    calls = {"n": 0}
    real = tuning.nelder_mead

    def interrupting(f, x0, budget, step=0.5, on_eval=None):
        calls["n"] += 1
        if calls["n"] == 2:
            f(x0)
            raise KeyboardInterrupt
        return real(f, x0, budget, step, on_eval)

    monkeypatch.setattr(tuning, "nelder_mead", interrupting)
    args = ["tune-schedule", str(ckpt), "--steps", "2,3", "--sampler", "ddim", "--evaluations", "4", "--reference-steps", "200", "--force"]
    args += ["--tune-n", "1", "--tune-length", "6", "--held-out-n", "1", "--held-out-lengths", "6", "--quiet"]
    assert main(args) == 130
    written = load_schedules(ckpt, weights=ckpt / "model.safetensors")
    assert written is not None and written.steps_tuned("ddim") == [2, 3]


def test_steps_below_the_samplers_order_are_refused() -> None:
    tuner = Tuner(oracle_pipeline(), TuningSettings("dpm3m", (2,)))
    with pytest.raises(ValueError, match=re.escape("steps=2 is below the dpm3m sampler's order 3; allowed: >= 3")):
        tune_grid(tuner, 2)


def test_a_default_without_its_grid_is_refused() -> None:
    bad = dataclasses.replace(schedules(), defaults={"ddim": 5})
    with pytest.raises(ScheduleError, match=re.escape("the default of ddim is 5 steps, but no such grid is tuned; tuned: [2]")):
        bad.check()


def test_the_tuned_grid_travels_with_the_export_and_runs_on_onnx_runtime(tiny_checkpoint: Path, export_dir: Path, tmp_path: Path) -> None:
    """The denoiser takes t as an input: tuning changes no graph (the export's ONNX files are byte for byte those
    of the same checkpoint's export before tuning, ``export_dir``), the export carries schedules.json bound to the
    weights, and ONNX Runtime with it gives the eager tuned tokens."""
    import shutil

    from ldlm.export.artifact import ArtifactError, read_manifest, read_schedules
    from ldlm.export.onnx_export import export_graphs
    from ldlm.serve.runtime.backends import BackendGraphs, open_graphs

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    before = read_manifest(export_dir)
    weights = weights_sha256(ckpt / "model.safetensors")
    TunedSchedules(weights, CONFIG.t_min, (TunedGrid("ddim", 3, (1.0, 0.6, 0.2, 0.05)),), {"ddim": 3}).save(ckpt / "schedules.json")
    after = export_graphs(ckpt, tmp_path / "after", with_logits=True).manifest  # as export_dir was
    assert {g: e["files"] for g, e in after["graphs"].items()} == {g: e["files"] for g, e in before["graphs"].items()}
    assert after["checkpoint_weights_sha256"] == weights and read_manifest(tmp_path / "after")["schedules"]["file"] == "schedules.json"
    tuned = read_schedules(tmp_path / "after")
    assert tuned is not None and tuned.defaults == {"ddim": 3} and read_schedules(export_dir) is None
    graphs, config, tokenizer = open_graphs("ort", tmp_path / "after")
    on_ort = LDLMPipeline(BackendGraphs(graphs), tokenizer, config=config, schedules=tuned).generate(2, 8, seed=4, sampler="ddim")
    eager = LDLMPipeline.from_checkpoint(ckpt)
    assert torch.equal(on_ort.token_ids, eager.generate(2, 8, seed=4, sampler="ddim").token_ids)
    assert torch.equal(on_ort.token_ids, eager.generate(2, 8, 3, 4, "ddim", grid="tuned").token_ids)
    (tmp_path / "after" / "schedules.json").write_text((tmp_path / "after" / "schedules.json").read_text().replace("0.6", "0.7"))
    with pytest.raises(ArtifactError, match="schedules.json does not match the sha256"):
        read_schedules(tmp_path / "after")


def test_the_server_says_which_grids_it_uses_and_defaults_to_the_tuned_ones(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Served eager from a checkpoint whose default sampler is tuned: /v1/generate without steps runs the tuned
    default (3 steps on the tuned grid) and gets its tokens; the start says so, and says when there are no tuned grids."""
    import shutil

    import httpx

    from ldlm.serve.api.service import LDLMService, ServerSettings
    from tests.servers import RunningServer, free_port

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    said: list[str] = []
    settings = ServerSettings(port=free_port(), backend="eager")
    LDLMService(str(ckpt), settings, progress=said.append).close()
    assert any("no tuned step grids" in line for line in said)
    weights = weights_sha256(ckpt / "model.safetensors")
    TunedSchedules(weights, CONFIG.t_min, (TunedGrid(CONFIG.default_sampler, 3, (1.0, 0.6, 0.2, 0.05)),), {CONFIG.default_sampler: 3}).save(
        ckpt / "schedules.json"
    )
    said.clear()
    service = LDLMService(str(ckpt), dataclasses.replace(settings, port=free_port()), progress=said.append)
    assert any(f"defaults: {CONFIG.default_sampler} at 3 steps" in line for line in said)
    running = RunningServer(service)
    try:
        got = httpx.post(f"{running.url}/v1/generate", json={"n": 2, "length": 8, "seed": 4}, timeout=60).json()
    finally:
        running.stop()
        service.close()
    expected = LDLMPipeline.from_checkpoint(ckpt).generate(2, 8, 3, 4, grid="tuned")
    assert got["token_ids"] == expected.ids()
    cooler = TunedSchedules(
        weights, CONFIG.t_min, (TunedGrid(CONFIG.default_sampler, 3, (1.0, 0.6, 0.2, 0.05)),), {}, prior_temperature=0.5
    )
    cooler.save(ckpt / "schedules.json")
    said.clear()
    LDLMService(str(ckpt), dataclasses.replace(settings, port=free_port()), progress=said.append).close()
    assert any(
        "were tuned at t_min=0.05, prior_temperature=0.5, and the config asks for t_min=0.05, prior_temperature=1.0" in line
        for line in said
    )


def test_the_search_minimizes_the_worst_samples_error_or_the_pooled_one() -> None:
    """The search error against a per-sample loop in NumPy: the largest of the samples' relative errors
    ("worst"), or one relative error over all samples together ("pooled", the default)."""
    import numpy as np

    pipe = oracle_pipeline()
    times = (1.0, 0.6, 0.25, 0.05)
    worst = Tuner(pipe, TuningSettings("ddim", reference_steps=200, tune_n=4, tune_length=8, objective="worst"))
    samples = worst.samples(3, 4, 8)
    x = worst.latents(3, 4, 8, "ddim", 3, times).double().numpy()
    ref = samples.reference.double().numpy()
    per_sample = [np.linalg.norm(x[i] - ref[i]) / np.linalg.norm(ref[i]) for i in range(4)]
    assert worst.search_error(samples, "ddim", 3, times) == pytest.approx(max(per_sample), rel=1e-5)
    pooled = Tuner(pipe, TuningSettings("ddim", reference_steps=200, tune_n=4, tune_length=8), worst.references)
    assert pooled.search_error(samples, "ddim", 3, times) == pytest.approx(np.linalg.norm(x - ref) / np.linalg.norm(ref), rel=1e-5)
    assert max(per_sample) > min(per_sample)  # the samples differ, so the two objectives do
    with pytest.raises(ValueError, match=re.escape("objective='median'; allowed: worst, pooled")):
        TuningSettings("ddim", objective="median")
