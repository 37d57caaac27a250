"""A whole training run on the micro model: it learns, it resumes to the same weights, it leaves no partial state."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import ldlm.training.run as run_module
from ldlm.model.checkpoint import init_model
from ldlm.training import train
from ldlm.training.corpus import Corpus
from ldlm.training.evaluation import reconstruction_accuracy
from ldlm.training.run import STATE_FILE
from tests.ldlm.training.conftest import MICRO, MICRO_PLAN


def test_the_autoencoder_learns_the_corpus(micro_corpus: Corpus, tmp_path: Path) -> None:
    model = init_model(MICRO, seed=0)
    (before,) = reconstruction_accuracy(model, micro_corpus.held_out, 16)
    plan = dataclasses.replace(
        MICRO_PLAN,
        autoencoder_steps=150,
        long_steps=0,
        denoiser_steps=0,
        latent_noise=0.0,
        autoencoder_lr=5e-3,
        warmup_steps=10,
        full_length_fraction=0.0,
    )
    log = train(model, micro_corpus, plan, tmp_path / "state", progress_bar=False)
    after = log["reconstruction_held_out"]["16"]
    assert before < 0.1 and after > 0.3, (before, after)  # chance is 1/40: the autoencoder is learning to copy
    assert [after] == pytest.approx(reconstruction_accuracy(model, micro_corpus.held_out, 16))
    quarters = log["reconstruction_held_out_quarters_32"]  # four equal spans of positions: their mean is the whole
    assert len(quarters) == 4 and np.mean(quarters) == pytest.approx(log["reconstruction_held_out"]["32"])
    assert quarters == pytest.approx(reconstruction_accuracy(model, micro_corpus.held_out, 32, parts=4))
    assert set(log) >= {"autoencoder_history", "reconstruction_held_out_first_stage", "reconstruction_held_out", "denoiser_held_out"}
    assert json.loads((tmp_path / "state" / STATE_FILE).read_text())["stage"] == "done"


@pytest.mark.parametrize("stage", ["denoiser", "decoder"])
def test_an_interrupted_run_resumes_to_the_uninterrupted_weights(
    micro_corpus: Corpus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stage: str
) -> None:
    uninterrupted = init_model(MICRO, seed=0)
    train(uninterrupted, micro_corpus, MICRO_PLAN, tmp_path / "a", progress_bar=False)

    calls = {"n": 0}
    real_loss = getattr(run_module, f"{stage}_loss")

    def interrupted_loss(*args: object, **kwargs: object) -> object:
        calls["n"] += 1
        if calls["n"] == 4:  # Ctrl-C in the middle of the stage, after 3 steps were saved
            raise KeyboardInterrupt
        return real_loss(*args, **kwargs)  # type: ignore[operator]

    monkeypatch.setattr(run_module, f"{stage}_loss", interrupted_loss)
    first = init_model(MICRO, seed=0)
    with pytest.raises(KeyboardInterrupt):
        train(first, micro_corpus, MICRO_PLAN, tmp_path / "b", save_every_s=0.0, progress_bar=False)
    saved = json.loads((tmp_path / "b" / STATE_FILE).read_text())
    assert (saved["stage"], saved["step"]) == (stage, 3)
    monkeypatch.setattr(run_module, f"{stage}_loss", real_loss)

    resumed = init_model(MICRO, seed=1)  # other initial weights: everything must come from the saved state
    train(resumed, micro_corpus, MICRO_PLAN, tmp_path / "b", progress_bar=False)
    expected, found = uninterrupted.state_dict(), resumed.state_dict()
    assert all(torch.equal(expected[name], found[name]) for name in expected), [
        n for n in expected if not torch.equal(expected[n], found[n])
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temporary state directory left beside


def test_the_decoder_stage_changes_the_decoders_and_nothing_else(micro_corpus: Corpus, tmp_path: Path) -> None:
    """Two runs that differ only in decoder steps: every stage before it draws the same batches, so
    the encoder, the denoiser and the statistics match to the bit, and the decoders do not."""
    without, with_stage = init_model(MICRO, seed=0), init_model(MICRO, seed=0)
    train(without, micro_corpus, dataclasses.replace(MICRO_PLAN, decoder_steps=0), tmp_path / "a", progress_bar=False)
    log = train(with_stage, micro_corpus, MICRO_PLAN, tmp_path / "b", progress_bar=False)
    before, after = without.state_dict(), with_stage.state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all(name.startswith(("latent_decoder.", "token_decoder.")) for name in changed), sorted(changed)
    assert {name.split(".")[0] for name in changed} == {"latent_decoder", "token_decoder"}
    assert len(log["decoder_history"]) == 1 and "reconstruction_held_out_autoencoder" in log
    assert log["reconstruction_held_out"]["16"] == pytest.approx(reconstruction_accuracy(with_stage, micro_corpus.held_out, 16)[0])


def test_a_plan_longer_than_the_model_is_refused(micro_corpus: Corpus, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_length=128 is out of range: at most the config's max_seq_len 32"):
        train(init_model(MICRO, seed=0), micro_corpus, dataclasses.replace(MICRO_PLAN, max_length=128, tokens_per_batch=256), tmp_path)


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here: training on a GPU (train_reference.py --device cuda) was not exercised",
)
def test_a_run_on_cuda_draws_the_cpu_runs_batches_and_learns_as_much(micro_corpus: Corpus, tmp_path: Path) -> None:
    on_cpu = init_model(MICRO, seed=0)
    on_cuda = init_model(MICRO, seed=0).to("cuda")
    cpu_log = train(on_cpu, micro_corpus, MICRO_PLAN, tmp_path / "cpu", progress_bar=False)
    cuda_log = train(on_cuda, micro_corpus, MICRO_PLAN, tmp_path / "cuda", progress_bar=False)
    assert next(on_cuda.parameters()).is_cuda
    # the same batches and noise from the same init: the first step's losses agree to float rounding;
    # after it rounding compounds, so the two runs are held to the same outcome, not the same weights
    assert cuda_log["autoencoder_history"][0] == pytest.approx(cpu_log["autoencoder_history"][0], rel=1e-3)
    for length, accuracy in cpu_log["reconstruction_held_out"].items():
        assert cuda_log["reconstruction_held_out"][length] == pytest.approx(accuracy, abs=0.1), length
