"""Calibration inputs for static (Q/DQ) quantization: each graph's inputs as the pipeline really makes them.

Static quantization fixes one scale per activation tensor from the ranges seen on calibration data, so
that data must look like what the graph sees when it runs:

- denoiser: (x_t, t, x0_prev, attention_mask) at every step of the config's default sampler along its
  default time grid (or the checkpoint's tuned grid, as ``ldlm generate`` would pick), recorded from
  the eager pipeline's sampling engine. Activation ranges move with t: near t = 1 the input is almost
  pure noise (x_t = alpha_t x0 + sigma_t eps with sigma_t -> 1) and x0_prev is zero (self-conditioning
  starts empty); near t_min x_t is nearly the clean latent. Random inputs at a few t would miss both.
  Measured on tiny (int8, ONNX Runtime CPU, held-out trajectory): calibrated on every step, the
  denoiser's worst per-sample cosine with fp32 is 0.99996; calibrated on the t = 1 step alone, 0.954;
- encoder: GPT-2 token ids of fixed English sentences (``CALIBRATION_TEXTS``), tokenized with the
  checkpoint's tokenizer and padded into one masked batch; no data set is downloaded;
- decoder: the encoder's standardized latents of those sentences (what a reconstruction decodes; the
  sampler's final latents have the same standardized scale).

Everything is seeded (``CalibrationSettings.seed``: the sampler's prior and noise), so the same
checkpoint and settings give the same feeds, and the scales in the Q/DQ graph are reproducible.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from onnxruntime.quantization import CalibrationDataReader
from torch import Tensor

from ldlm.export.quantize import Feed
from ldlm.model.checkpoint import WEIGHTS_FILE
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling.loop import run_lockstep
from ldlm.sampling.request import GenerateRequest, SamplingPlan, resolve
from ldlm.sampling.tuned_grids import weights_sha256

CALIBRATION_TEXTS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times.",
    "Please send the quarterly report to the finance team before Friday.",
    "Rain is expected in the north tomorrow, with clear skies in the south.",
    "She opened the old letter and read it twice before she spoke.",
    "The function returns a list of every file in the directory.",
    "Our train left the station at seven and arrived two hours late.",
    "Water boils at one hundred degrees Celsius at sea level.",
)
MAX_SAMPLES = 256  # trajectories per denoiser feed: more only slows calibration down


class CalibrationError(ValueError):
    """Calibration settings or a checkpoint that cannot calibrate this export; the message says what is allowed."""


@dataclass(frozen=True)
class CalibrationSettings:
    samples: int = 8  # sampler trajectories, run together: each denoiser feed is (samples, length, D)
    length: int = 16  # positions per trajectory
    seed: int = 0  # the trajectories' prior and noise
    texts: tuple[str, ...] = field(default=CALIBRATION_TEXTS)  # encoder and decoder calibration sentences

    def __post_init__(self) -> None:
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or not 1 <= self.samples <= MAX_SAMPLES:
            raise CalibrationError(f"calibration samples={self.samples!r} is out of range; allowed: 1..{MAX_SAMPLES}")
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 1:
            raise CalibrationError(f"calibration length={self.length!r} is out of range; allowed: 1..max_seq_len of the config")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise CalibrationError(f"calibration seed={self.seed!r} is out of range; allowed: an integer >= 0")
        if not self.texts or not all(isinstance(t, str) and t.strip() for t in self.texts):
            raise CalibrationError("calibration texts are empty; allowed: at least one non-empty sentence")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "texts": list(self.texts)}


class FeedReader(CalibrationDataReader):
    """A fixed list of feeds as ONNX Runtime's calibration reader; ``rewind`` starts it over."""

    def __init__(self, feeds: Sequence[Feed]) -> None:
        if not feeds:
            raise CalibrationError("no calibration feeds; allowed: at least one")
        self.feeds = list(feeds)
        self._next: Iterator[Feed] = iter(self.feeds)

    def get_next(self) -> Feed | None:
        return next(self._next, None)

    def rewind(self) -> None:
        self._next = iter(self.feeds)


def calibration_pipeline(checkpoint: str | os.PathLike[str], manifest: dict[str, Any]) -> LDLMPipeline:
    """The eager pipeline of ``checkpoint``, refused unless it is the checkpoint the export (``manifest``) was made
    from: scales calibrated on other weights would not fit the graph's weights."""
    weights = Path(checkpoint) / WEIGHTS_FILE
    if not weights.is_file():
        raise CalibrationError(
            f"calibration checkpoint {checkpoint} has no {WEIGHTS_FILE}; allowed: the checkpoint the export was made from"
        )
    expected = manifest.get("checkpoint_weights_sha256")
    if expected is not None and weights_sha256(weights) != expected:
        raise CalibrationError(
            f"calibration checkpoint {checkpoint} is not the one the export was made from "
            f"(its {WEIGHTS_FILE} sha256 differs from the manifest's checkpoint_weights_sha256); allowed: that checkpoint"
        )
    pipeline = LDLMPipeline.from_checkpoint(checkpoint)
    if pipeline.config.config_hash() != manifest["config_sha256"]:
        raise CalibrationError(f"calibration checkpoint {checkpoint} has another config than the export (config_sha256 differs)")
    return pipeline


def denoiser_feeds(pipeline: LDLMPipeline, settings: CalibrationSettings) -> tuple[list[Feed], SamplingPlan]:
    """One feed per step of the default sampler on its default grid: ``settings.samples`` seeded trajectories of
    ``settings.length`` positions, recorded as the sampling engine hands them to the denoiser."""
    pipeline.check_length(settings.length, "calibration length")
    request = GenerateRequest(settings.samples, settings.length, seed=settings.seed)
    plan = resolve(request, pipeline.config, schedules=pipeline.schedules)
    states = pipeline.engine.start(plan, pipeline.config.d_model)
    feeds: list[Feed] = []

    def recording_denoise(x_t: Tensor, t: Tensor, x0_prev: Tensor, mask: Tensor | None) -> Tensor:
        full = torch.ones(x_t.shape[:2], dtype=torch.bool) if mask is None else mask  # None: no padding
        feeds.append(
            {
                "x_t": _array(x_t, np.float32),
                "t": _array(t, np.float32),
                "x0_prev": _array(x0_prev, np.float32),
                "attention_mask": _array(full, np.int64),  # the graphs take an int64 mask (export/graphs.py)
            }
        )
        return pipeline.graphs.denoise(x_t, t, x0_prev, mask)

    with torch.inference_mode():
        run_lockstep(pipeline.engine, states, recording_denoise)
    return feeds, plan


def encoder_feeds(pipeline: LDLMPipeline, settings: CalibrationSettings) -> list[Feed]:
    """The calibration sentences' token ids as one batch, right-padded with end-of-text to the longest and
    masked, as ``LDLMPipeline.encode`` sends them. One batch, because ONNX Runtime's histogram calibration
    (fp8) stacks each tensor across feeds, which needs one shape."""
    encoded = pipeline.encode(pipeline.text_ids(settings.texts))
    return [{"input_ids": _array(encoded.token_ids, np.int64), "attention_mask": _array(encoded.attention_mask, np.int64)}]


def decoder_feeds(pipeline: LDLMPipeline, settings: CalibrationSettings) -> list[Feed]:
    """The encoder's latents of the calibration sentences (one padded, masked batch, as in ``encoder_feeds``),
    as the decoder reads them in a reconstruction."""
    encoded = pipeline.encode(pipeline.text_ids(settings.texts))
    return [{"latents": _array(encoded.latents, np.float32), "attention_mask": _array(encoded.attention_mask, np.int64)}]


def calibration_reader(pipeline: LDLMPipeline, graph: str, settings: CalibrationSettings) -> FeedReader:
    """The calibration reader of ``graph`` (encoder, denoiser or decoder)."""
    if graph == "denoiser":
        return FeedReader(denoiser_feeds(pipeline, settings)[0])
    if graph == "encoder":
        return FeedReader(encoder_feeds(pipeline, settings))
    if graph == "decoder":
        return FeedReader(decoder_feeds(pipeline, settings))
    raise CalibrationError(f"graph={graph!r} has no calibration inputs; allowed: encoder, denoiser, decoder")


def _array(tensor: Tensor, dtype: type) -> np.ndarray:
    return tensor.detach().cpu().numpy().astype(dtype)
