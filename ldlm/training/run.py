"""A training run: the stages in order, saved as it goes, resumable.

1. ``features``: GPT-2's (frozen) feature statistics, which standardize the features.
2. ``autoencoder``: latent encoder, latent decoder and token decoder, end to end.
3. ``autoencoder_long``: the same at full-length windows (with padding), at a lower learning rate.
4. ``latents``: the frozen encoder's latent statistics (the cache of latents is rebuilt on resume).
5. ``denoiser``: on the cached latents.
6. ``decoder``: the latent and token decoders again, on the encoder's latents and on the denoiser's.

The state (``state_dir``: the model as a checkpoint, the optimizer's tensors in safetensors, and
``state.json``) is written whole every ``save_every_s`` seconds and after every stage; a run started
again on the same directory resumes at the saved step and makes the batches the uninterrupted run
would have made.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor
from tqdm import tqdm

from ldlm.files import atomic_directory
from ldlm.model.checkpoint import CONFIG_FILE, WEIGHTS_FILE, check_state_dict, read_safetensors
from ldlm.model.ldlm import LDLM
from ldlm.sampling.schedule import TangentSchedule
from ldlm.training.corpus import Corpus
from ldlm.training.evaluation import denoiser_evaluation, reconstruction_accuracy
from ldlm.training.objectives import (
    STAGES,
    VocabularyHead,
    autoencoder_loss,
    cache_latents,
    decoder_loss,
    denoiser_loss,
    device_of,
    draw,
    feature_statistics,
    latent_batch,
    latent_statistics,
    learning_rate,
    text_batch,
)
from ldlm.training.plan import DENOISER_LENGTHS, TrainingPlan
from ldlm.training.routing import align_routing

OPTIMIZER_FILE = "optimizer.safetensors"
STATE_FILE = "state.json"
RECONSTRUCTION_LENGTHS = (16, 32, 64, 128)
# The stages that train the token decoder's head, and the log entry of the held-out reconstruction
# after each of them; the last is the checkpoint's
RECONSTRUCTION_LOGS = {
    "autoencoder": "reconstruction_held_out_first_stage",
    "autoencoder_long": "reconstruction_held_out_autoencoder",
    "decoder": "reconstruction_held_out",
}


@dataclass
class Progress:
    """Where a run stands: the stage, the step within it, and the log of losses and evaluations."""

    stage: str = STAGES[0]
    step: int = 0
    log: dict[str, Any] = field(default_factory=dict)


def optimizer_for(model: LDLM, head: VocabularyHead, stage: str, plan: TrainingPlan) -> torch.optim.AdamW:
    if stage == "denoiser":
        return torch.optim.AdamW(model.denoiser.parameters(), lr=plan.denoiser_lr, weight_decay=plan.weight_decay)
    # the full head is trained through its restricted copy; the decoder stage leaves the encoder as it is
    full_head = {id(p) for p in model.token_decoder.head.parameters()}
    decoders = (model.latent_decoder, model.token_decoder)
    modules = decoders if stage == "decoder" else (model.latent_encoder, *decoders)
    params = [p for module in modules for p in module.parameters() if id(p) not in full_head] + list(head.parameters())
    lr = plan.decoder_lr if stage == "decoder" else plan.autoencoder_lr
    return torch.optim.AdamW(params, lr=lr, weight_decay=plan.weight_decay)


def save_state(directory: Path, model: LDLM, optimizer: torch.optim.Optimizer | None, progress: Progress) -> None:
    """The run's state, written whole or not at all (the previous state stays until the new one is complete)."""
    with atomic_directory(directory, overwrite=True) as tmp:
        model.config.save(tmp / CONFIG_FILE)
        state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "config_sha256": model.config.config_hash()})
        groups: list[dict[str, Any]] = []
        if optimizer is not None:
            saved = optimizer.state_dict()
            tensors = {f"{index}.{key}": value.contiguous() for index, per in saved["state"].items() for key, value in per.items()}
            save_file(tensors, str(tmp / OPTIMIZER_FILE))
            groups = saved["param_groups"]
        meta = {"stage": progress.stage, "step": progress.step, "log": progress.log, "param_groups": groups}
        (tmp / STATE_FILE).write_text(json.dumps(meta))


def load_state(directory: Path, model: LDLM) -> tuple[Progress, dict[str, Any] | None]:
    """Restore the model from a saved state; returns the progress and the optimizer's state dict."""
    meta = json.loads((directory / STATE_FILE).read_text())
    state = read_safetensors(directory / WEIGHTS_FILE)
    check_state_dict(model.state_dict(), state, directory / WEIGHTS_FILE)
    model.load_state_dict(state)
    optimizer_state = None
    if (directory / OPTIMIZER_FILE).is_file():
        per: dict[int, dict[str, Tensor]] = {}
        for name, tensor in read_safetensors(directory / OPTIMIZER_FILE).items():
            index, key = name.split(".", 1)
            per.setdefault(int(index), {})[key] = tensor
        optimizer_state = {"state": per, "param_groups": meta["param_groups"]}
    return Progress(meta["stage"], meta["step"], meta["log"]), optimizer_state


class Run:
    """One training run over ``corpus`` with ``plan``, its state in ``state_dir``."""

    def __init__(self, model: LDLM, corpus: Corpus, plan: TrainingPlan, state_dir: Path, save_every_s: float, progress_bar: bool) -> None:
        plan.check()
        if plan.max_length > model.config.max_seq_len:
            raise ValueError(f"max_length={plan.max_length} is out of range: at most the config's max_seq_len {model.config.max_seq_len}")
        self.model, self.corpus, self.plan, self.state_dir = model, corpus, plan, state_dir
        self.save_every_s, self.progress_bar = save_every_s, progress_bar
        self.schedule = TangentSchedule(model.config.schedule_d, model.config.beta_clip_t)
        resumed = (state_dir / STATE_FILE).is_file()
        self.progress, self.optimizer_state = load_state(state_dir, model) if resumed else (Progress(), None)
        if plan.aligned_routing and not resumed:
            align_routing(model)
        self.device = device_of(model)
        # after loading: a saved state holds the sealed full head
        self.head = VocabularyHead(corpus.vocabulary, model).to(self.device)
        self.cache: dict[int, Tensor] | None = None
        self.started, self.seconds_before = time.monotonic(), float(self.progress.log.get("train_seconds", 0.0))
        model.feature_model.requires_grad_(False)

    def train(self) -> dict[str, Any]:
        while self.progress.stage != "done":
            stage = self.progress.stage
            if stage == "features":
                feature_statistics(self.model, self.corpus.train, length=self.plan.max_length, seed=self.plan.seed)
            elif stage == "latents":
                latent_statistics(self.model, self.latent_cache())
            else:
                self.optimize(stage)
            self.evaluate(stage)
            self.progress = Progress(STAGES[STAGES.index(stage) + 1], 0, self.progress.log)
            self.clock()
            save_state(self.state_dir, self.model, None, self.progress)
        return self.progress.log

    def latent_cache(self) -> dict[int, Tensor]:
        if self.cache is None:  # also rebuilt when resumed inside the denoiser stage: it is not saved
            lengths = tuple(n for n in DENOISER_LENGTHS if n <= self.plan.max_length) or (self.plan.max_length,)
            self.cache = cache_latents(self.model.eval(), self.corpus.train, self.plan.cache_tokens, self.plan.seed, lengths)
        return self.cache

    def optimize(self, stage: str) -> None:
        model, plan = self.model, self.plan
        total, peak = {
            "autoencoder": (plan.autoencoder_steps, plan.autoencoder_lr),
            "autoencoder_long": (plan.long_steps, plan.long_lr),
            "denoiser": (plan.denoiser_steps, plan.denoiser_lr),
            "decoder": (plan.decoder_steps, plan.decoder_lr),
        }[stage]
        warmup = min(plan.warmup_steps, total // 10)  # a short stage warms up for a tenth of it
        if stage == "denoiser":
            self.latent_cache()  # built (or rebuilt, on resume) before the first step
        optimizer = optimizer_for(model, self.head, stage, plan)
        if self.optimizer_state is not None:
            optimizer.load_state_dict(self.optimizer_state)
            self.optimizer_state = None
        history = self.progress.log.setdefault(f"{stage}_history", [])
        last_save = time.monotonic()
        bar = tqdm(
            range(self.progress.step, total),
            desc=stage,
            initial=self.progress.step,
            total=total,
            disable=not self.progress_bar,
            unit="step",
        )
        model.train()
        for step in bar:
            rng, gen = draw(plan.seed, stage, step)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, total, peak, warmup)
            loss, stats = self.loss(stage, step, rng, gen)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
            optimizer.step()
            bar.set_postfix({k: f"{v:.3f}" for k, v in stats.items() if k != "accuracy"})
            if step % 100 == 0:
                history.append({"step": step, **stats})
            if time.monotonic() - last_save > self.save_every_s:
                self.save(stage, step + 1, optimizer)
                last_save = time.monotonic()
        model.eval()

    def loss(self, stage: str, step: int, rng: np.random.Generator, gen: torch.Generator) -> tuple[Tensor, dict[str, float]]:
        """One step's loss and statistics: the stage's objective on the step's batch."""
        model, plan = self.model, self.plan
        if stage == "denoiser":
            z = latent_batch(self.latent_cache(), plan, model, rng)
            return denoiser_loss(model, self.schedule, z, bool(rng.random() < plan.self_condition), gen, plan.focus_fraction)
        input_ids, mask = text_batch(self.corpus.train, plan, rng, full_length=stage == "autoencoder_long")
        batch = (input_ids.to(self.device), mask.to(self.device))
        if stage == "decoder":
            denoised = bool(rng.random() < plan.denoised_fraction)
            return decoder_loss(model, self.head, self.schedule, batch, denoised, plan, gen, step % 100 == 0)
        return autoencoder_loss(model, self.head, *batch, plan, gen, step % 100 == 0)

    def clock(self) -> None:
        """The run's training time so far, resumed runs included, into the log."""
        self.progress.log["train_seconds"] = round(self.seconds_before + time.monotonic() - self.started, 1)

    def save(self, stage: str, step: int, optimizer: torch.optim.Optimizer) -> None:
        self.clock()
        self.model.eval()
        if stage in RECONSTRUCTION_LOGS:
            self.head.seal(self.model)  # the restricted head's rows go into the full head that is saved
        save_state(self.state_dir, self.model, optimizer, Progress(stage, step, self.progress.log))
        self.model.train()

    def evaluate(self, stage: str) -> None:
        log = self.progress.log
        if stage in RECONSTRUCTION_LOGS:
            self.head.seal(self.model)
            name = RECONSTRUCTION_LOGS[stage]
            lengths = [n for n in RECONSTRUCTION_LENGTHS if n <= self.plan.max_length]
            log[name] = {str(n): reconstruction_accuracy(self.model, self.corpus.held_out, n)[0] for n in lengths}
            # by quarter of the positions at the longest length: the last positions learn last
            log[f"{name}_quarters_{lengths[-1]}"] = reconstruction_accuracy(self.model, self.corpus.held_out, lengths[-1], parts=4)
        elif stage == "denoiser":
            log["denoiser_held_out"] = denoiser_evaluation(self.model, self.schedule, self.corpus.held_out, min(64, self.plan.max_length))


def train(
    model: LDLM, corpus: Corpus, plan: TrainingPlan, state_dir: Path, save_every_s: float = 120.0, progress_bar: bool = True
) -> dict[str, Any]:
    """Run (or resume, from ``state_dir``) every stage; returns the log of losses and evaluations."""
    return Run(model, corpus, plan, state_dir, save_every_s, progress_bar).train()
