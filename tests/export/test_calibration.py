"""Calibration inputs are the pipeline's own: the denoiser's along the default sampler's trajectory at the
default grid's times (checked against the grid and the schedule's closed forms), the encoder's from real
sentences, the decoder's the encoder's latents of them; seeded; bad settings refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ldlm.export.artifact import read_manifest
from ldlm.export.calibration import (
    CALIBRATION_TEXTS,
    CalibrationError,
    CalibrationSettings,
    FeedReader,
    calibration_pipeline,
    calibration_reader,
    decoder_feeds,
    denoiser_feeds,
    encoder_feeds,
)
from ldlm.model.checkpoint import init_model, save_checkpoint
from ldlm.model.config import LDLMConfig
from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline

SMALL = CalibrationSettings(samples=4, length=8, seed=3)


@pytest.fixture(scope="module")
def trajectory(pipeline: LDLMPipeline) -> list[dict[str, np.ndarray]]:
    return denoiser_feeds(pipeline, SMALL)[0]


def power_grid(steps: int, t_min: float) -> np.ndarray:
    """The default sampler's grid in closed form: t_k = t_min + (1 - t_min) (1 - k / steps)^1.5."""
    k = np.arange(steps + 1)
    return t_min + (1 - t_min) * (1 - k / steps) ** 1.5


def alpha_sigma(t: np.ndarray, d: float) -> tuple[np.ndarray, np.ndarray]:
    """The tangent schedule: alpha_t = (1 + d^2 tan^2(pi t / 2))^(-1/2), sigma_t = sqrt(1 - alpha_t^2)."""
    alpha = (1 + d**2 * np.tan(np.pi * t / 2) ** 2) ** -0.5
    return alpha, np.sqrt(1 - alpha**2)


def test_denoiser_feeds_are_the_default_samplers_steps_on_the_default_grid(trajectory, tiny_config: LDLMConfig) -> None:
    assert tiny_config.default_sampler == "dpm3m-psc"  # its grid is "power" (ldlm/sampling/samplers.py)
    grid = power_grid(tiny_config.default_steps, tiny_config.t_min)
    assert len(trajectory) == tiny_config.default_steps  # one denoiser call per step, the last time t_min not called
    for k, feed in enumerate(trajectory):
        assert feed["x_t"].shape == feed["x0_prev"].shape == (4, 8, tiny_config.d_model) and feed["x_t"].dtype == np.float32
        assert feed["attention_mask"].dtype == np.int64 and feed["attention_mask"].all()
        np.testing.assert_allclose(feed["t"], np.full(4, grid[k], np.float32), rtol=0, atol=1e-6)


def test_x_t_carries_the_schedules_noise_level_at_each_t(trajectory, tiny_config: LDLMConfig) -> None:
    """x_t = alpha_t x0 + sigma_t eps: with x0 the self-conditioning estimate x0_prev, what is left is noise of
    scale sigma_t. Exact for a first-order step; the third-order multistep solver drifts from it only near
    t_min (measured: within 1.00..1.08 of sigma_t for t >= 0.2, up to 1.5 at t = 0.06), so the check stops at 0.2."""
    first = trajectory[0]
    assert not first["x0_prev"].any()  # self-conditioning starts empty
    assert 0.9 < float(first["x_t"].std()) < 1.1  # t = 1: the N(0, I) prior (4 x 8 x 64 draws)
    checked = 0
    for feed in trajectory:
        t = float(feed["t"][0])
        if t < 0.2:
            continue
        alpha, sigma = alpha_sigma(np.float64(t), tiny_config.schedule_d)
        ratio = float((feed["x_t"] - alpha * feed["x0_prev"]).std() / sigma)
        assert 0.9 < ratio < 1.15, (t, ratio)
        checked += 1
    assert checked >= 14


def test_the_trajectory_is_seeded(pipeline: LDLMPipeline, trajectory) -> None:
    again = denoiser_feeds(pipeline, CalibrationSettings(samples=4, length=8, seed=3, texts=("Hi.",)))[0]
    other = denoiser_feeds(pipeline, CalibrationSettings(samples=4, length=8, seed=4))[0]
    for a, b in zip(trajectory, again):
        for name in a:
            np.testing.assert_array_equal(a[name], b[name])
    assert not np.allclose(trajectory[1]["x_t"], other[1]["x_t"])


def test_encoder_and_decoder_feeds_are_real_sentences_and_their_latents(pipeline: LDLMPipeline, tiny_model, tiny_config) -> None:
    ids = TextTokenizer.gpt2().encode(list(CALIBRATION_TEXTS))
    assert len(ids) == 8 and all(len(row) >= 8 for row in ids)
    (encoder,) = encoder_feeds(pipeline, CalibrationSettings())
    (decoder,) = decoder_feeds(pipeline, CalibrationSettings())
    longest = max(len(row) for row in ids)
    assert encoder["input_ids"].shape == encoder["attention_mask"].shape == (8, longest)
    for i, row in enumerate(ids):
        assert encoder["input_ids"][i, : len(row)].tolist() == row
        assert encoder["attention_mask"][i].tolist() == [1] * len(row) + [0] * (longest - len(row))
        assert (encoder["input_ids"][i, len(row) :] == tiny_config.eos_token_id).all()
        # the batched, padded latents of sentence i at its real positions equal a run of that sentence alone
        with torch.inference_mode():
            alone = tiny_model.encode_latents(torch.tensor([row]), torch.ones(1, len(row), dtype=torch.bool))[0].numpy()
        np.testing.assert_allclose(decoder["latents"][i, : len(row)], alone, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(decoder["attention_mask"], encoder["attention_mask"])


def test_the_reader_hands_out_every_feed_once_then_none(pipeline: LDLMPipeline) -> None:
    reader = calibration_reader(pipeline, "encoder", CalibrationSettings())
    assert isinstance(reader, FeedReader) and reader.get_next() is not None and reader.get_next() is None
    reader.rewind()
    assert reader.get_next() is not None


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(samples=0), "calibration samples=0 is out of range; allowed: 1..256"),
        (dict(samples=257), "calibration samples=257 is out of range; allowed: 1..256"),
        (dict(length=0), "calibration length=0 is out of range; allowed: 1..max_seq_len of the config"),
        (dict(seed=-1), "calibration seed=-1 is out of range; allowed: an integer >= 0"),
        (dict(texts=()), "calibration texts are empty; allowed: at least one non-empty sentence"),
    ],
)
def test_bad_settings_are_refused_naming_the_value_and_the_range(settings: dict, message: str) -> None:
    with pytest.raises(CalibrationError, match=f"^{message}$".replace("(", r"\(").replace(")", r"\)")):
        CalibrationSettings(**settings)


def test_a_length_past_the_config_and_an_unknown_graph_are_refused(pipeline: LDLMPipeline, tiny_config: LDLMConfig) -> None:
    too_long = tiny_config.max_seq_len + 1
    with pytest.raises(ValueError, match=rf"calibration length={too_long} is out of range; allowed: 1..{tiny_config.max_seq_len}"):
        denoiser_feeds(pipeline, CalibrationSettings(length=too_long))
    with pytest.raises(CalibrationError, match="graph='head' has no calibration inputs; allowed: encoder, denoiser, decoder"):
        calibration_reader(pipeline, "head", CalibrationSettings())


def test_only_the_checkpoint_the_export_was_made_from_calibrates_it(
    export_dir: Path, tiny_checkpoint: Path, tiny_config: LDLMConfig, tmp_path: Path
) -> None:
    manifest = read_manifest(export_dir)
    assert calibration_pipeline(tiny_checkpoint, manifest).config.config_hash() == manifest["config_sha256"]
    other = save_checkpoint(init_model(tiny_config, seed=1, norm_init="random"), TextTokenizer.gpt2(), tmp_path / "other")
    with pytest.raises(CalibrationError, match="is not the one the export was made from .its model.safetensors sha256 differs"):
        calibration_pipeline(other, manifest)
    with pytest.raises(CalibrationError, match="has no model.safetensors; allowed: the checkpoint the export was made from"):
        calibration_pipeline(tmp_path, manifest)
