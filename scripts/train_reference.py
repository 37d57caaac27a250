#!/usr/bin/env python
"""The recipe of the reference checkpoint: a tiny LDLM trained on Austen's six novels and Moby Dick.

    python scripts/train_reference.py --corpus DIR_WITH_DEBS --out models/ldlm-austen-tiny

The texts come from Debian's r-cran-janeaustenr and r-cran-tokenizers (installed, or their .deb files
in --corpus: `apt-get download r-cran-janeaustenr r-cran-tokenizers`); nothing is downloaded. The
stages (ldlm/training/) run in order: feature statistics, the autoencoder, the latent cache, the
denoiser, and the decoders again on the denoiser's latents too. The latent encoder and decoder start
aligned, position p reading position p (ldlm/training/routing.py; --no-aligned-routing starts from
PyTorch's init, which loses a window's last token at a third of the lengths). The state is saved to --state-dir every --save-every seconds and after each stage, so an
interrupted run started again with the same arguments resumes where it stopped. At the end the
checkpoint is evaluated on the held-out text (reconstruction, denoising loss, generated words) and
written whole to --out with SHA256SUMS, a model card (README.md) and training.json. --device cuda
trains on a GPU, drawing the same batches and noise on the CPU.

Why the tiny preset: every step's cost is dominated by the token decoder and GPT-2 at D=64, and
the whole recipe must finish in about 90 minutes on 2 CPU cores; the base preset would need days.
Its denoiser is deeper and wider than the preset's (--denoiser-layers, --swiglu-hidden; --denoiser-width also
widens its stream, which did not pay): the preset's 2 blocks with a 128-wide SwiGLU learn to denoise each position from its own latent alone, and
their samples are no more word-like than tokens drawn independently by frequency.
GPT-2 itself stays at its seeded random initialization (frozen): no GPT-2 weights can be had
offline, and a random transformer's features still carry every token's identity.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch

from ldlm.cli.options import prior_temperature
from ldlm.device import DeviceError, resolve_device
from ldlm.files import atomic_directory, refuse_existing
from ldlm.model.checkpoint import CHECKSUMS_FILE, CONFIG_FILE, WEIGHTS_FILE, init_model, save_checkpoint, write_checksums
from ldlm.model.config import preset
from ldlm.model.ldlm import LDLM, count_parameters
from ldlm.model.tokenizer import TextTokenizer
from ldlm.training import TrainingPlan, train
from ldlm.training.corpus import Corpus, CorpusError, load_corpus, load_documents
from ldlm.training.evaluation import held_out_windows, text_statistics, unigram_entropy_bits, words
from ldlm.training.plan import FOCUS_T

# The reference's denoiser, in place of the tiny preset's 2 blocks and 128-wide SwiGLU: 4 blocks of 512 read
# their neighbours (docs/measurements/denoiser-screen-2026-12-05.json). Their stream keeps the latents' width:
# a 128-wide one lowers the held-out loss and writes no more of the corpus's words (denoiser-width-screen-2026-12-05.json).
DENOISER_LAYERS = 4
SWIGLU_HIDDEN = 512
DENOISER_WIDTH = 0
# Unset (the exact prior, tau = 1): a cooler prior writes more of the corpus's words, but its ODE is harder
# to follow in few steps (prior-temperature-reference-2026-12-05.json), so it is the user's choice per request.
PRIOR_TEMPERATURE = None


def model_card(log: dict[str, Any], corpus: Corpus, plan: TrainingPlan, model: LDLM, minutes: float) -> str:
    rec, first, autoencoder = (
        log["reconstruction_held_out"],
        log["reconstruction_held_out_first_stage"],
        log["reconstruction_held_out_autoencoder"],
    )
    quarters = " / ".join(f"{q:.4f}" for q in log[f"reconstruction_held_out_quarters_{plan.max_length}"])
    den = log["denoiser_held_out"]
    trained, random = log["generated_text"], log["generated_text_random_weights"]
    examples = "\n".join(f"    {text[:160]!r}" for text in trained["examples"])
    start = (
        "the latent encoder and decoder aligned, each position reading its own position (`ldlm/training/routing.py`)"
        if plan.aligned_routing
        else "PyTorch's initialization"
    )
    return f"""# ldlm-austen-tiny: the reference checkpoint

**What it is:** a small reference of a learned distribution, for checking the tool chain on a model
that has learned something. It is **not a good language model**: its samples are mostly Austen's and
Melville's words, with word pieces, names and punctuation between them, and no syntax.

- Architecture: the `tiny` preset (D {model.config.d_model}, V {model.config.vocab_size}) with a denoiser of {model.config.denoiser_layers} blocks
  {model.config.denoiser_d_model} wide and a {model.config.swiglu_hidden}-wide SwiGLU; {count_parameters(model):,} parameters with GPT-2's.
- GPT-2 (the feature model) is its seeded random initialization, frozen: no GPT-2 weights can be had offline.
- Trained on: Jane Austen's six novels (Debian `r-cran-janeaustenr`) and Moby Dick (`r-cran-tokenizers`'
  `mobydick`, without Project Gutenberg's header and licence): {len(corpus.train):,} training tokens,
  {len(corpus.held_out):,} held out (the last 5% of every novel), {len(corpus.vocabulary):,} distinct token ids.
  The other GPT-2 ids never occur; their logits are fixed at -30 (weight 0), so they are never decoded.
- Recipe: `scripts/train_reference.py` (seed {plan.seed}), {minutes:.0f} minutes of training on {torch.get_num_threads()} CPU threads:
  - start: {start};
  - autoencoder: {plan.autoencoder_steps} steps of {plan.tokens_per_batch} tokens, {plan.full_length_fraction:.0%} of them at {plan.max_length} tokens and
    the rest at lengths {plan.min_length}..{plan.max_length} (log-uniform), {plan.short_fraction:.0%} of every batch's samples cut at a random length (padding after them); token cross-entropy (each sample's last real token weighted {plan.last_token_weight:g}) + {plan.feature_weight} x feature MSE,
    latent noise up to {plan.latent_noise} x RMS; then {plan.long_steps} steps at {plan.max_length} tokens (lr {plan.long_lr:g}): after the
    first part alone, held-out accuracy at {plan.max_length} tokens was {first[str(plan.max_length)]:.3f};
  - denoiser: {plan.denoiser_steps} steps of {plan.tokens_per_batch} tokens on the frozen encoder's latents
    (lengths 16/32/64/128), lr {plan.denoiser_lr:g}, x0-prediction MSE, self-conditioning on {plan.self_condition:.0%} of the batches,
    t ~ U(0, 1) for {1 - plan.focus_fraction:.0%} of the samples and U{FOCUS_T} for the rest (where neighbours decide a token);
  - decoders: {plan.decoder_steps} steps of the autoencoder's loss for the latent and token decoders alone (lr {plan.decoder_lr:g}),
    {plan.denoised_fraction:.0%} of the batches decoding the denoiser's self-conditioned x0_hat from t ~ U(0, {plan.denoised_t_max:g})
    in place of the encoder's latents, so the decoders learn the latents a sampler ends on; before this stage,
    held-out accuracy at 16 / 32 / 64 / 128 tokens was {" / ".join(f"{autoencoder[str(n)]:.4f}" for n in (16, 32, 64, 128) if str(n) in autoencoder)}.

## Held-out results

| measure | value |
|---|---|
| reconstruction token accuracy, L16 / 32 / 64 / 128 | {rec["16"]:.4f} / {rec["32"]:.4f} / {rec["64"]:.4f} / {rec["128"]:.4f} |
| the same at {plan.max_length} tokens, by quarter of the positions | {quarters} |
| denoiser MSE (standardized latents, 16 t in (0, 1), self-conditioned) | {den["denoiser_mse"]:.4f} |
| MSE of predicting the latent mean | {den["mean_prediction_mse"]:.4f} |
| generated words found in the corpus (default sampler, prior temperature {trained["prior_temperature"]:g}, {trained["samples"]} x {trained["length"]} tokens) | {trained["words_in_corpus_vocabulary"]:.3f} (random weights: {random["words_in_corpus_vocabulary"]:.3f}) |
| unigram entropy, bits per token: generated / held-out text, as many tokens | {trained["unigram_entropy_bits"]:.2f} / {log["corpus_unigram_entropy_bits"]:.2f} (random weights: {random["unigram_entropy_bits"]:.2f}) |

Samples (seed 0):

{examples}

`training.json` holds the loss curves, every figure above and the plan. `SHA256SUMS` lists the sha256
of the config, the weights and the tokenizer; `ldlm` refuses a copy whose files do not match it.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--corpus",
        type=Path,
        help="a directory with the corpus packages' .deb files or their unpacked tree (default: the installed packages)",
    )
    parser.add_argument("--out", type=Path, default=Path("models/ldlm-austen-tiny"), help="the checkpoint to write (default: %(default)s)")
    parser.add_argument("--state-dir", type=Path, default=Path("runs/train-reference"), help="the resumable state (default: %(default)s)")
    parser.add_argument("--preset", default="tiny", help="model preset (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--autoencoder-steps", type=int, default=TrainingPlan.autoencoder_steps)
    parser.add_argument(
        "--long-steps", type=int, default=TrainingPlan.long_steps, help="full-length autoencoder steps (default: %(default)s)"
    )
    parser.add_argument("--denoiser-steps", type=int, default=TrainingPlan.denoiser_steps)
    parser.add_argument(
        "--decoder-steps",
        type=int,
        default=TrainingPlan.decoder_steps,
        help="steps of the decoders on encoder and denoiser latents (default: %(default)s)",
    )
    parser.add_argument(
        "--last-token-weight",
        type=float,
        default=TrainingPlan.last_token_weight,
        help="weight of each sample's last real token in the token loss, 1 elsewhere (default: %(default)s)",
    )
    parser.add_argument(
        "--short-fraction",
        type=float,
        default=TrainingPlan.short_fraction,
        help="share of every autoencoder batch's samples cut at a random length, padding after (default: %(default)s)",
    )
    parser.add_argument(
        "--aligned-routing",
        action=argparse.BooleanOptionalAction,
        default=TrainingPlan.aligned_routing,
        help="start the latent encoder and decoder with position p reading position p (ldlm/training/routing.py) (default: %(default)s)",
    )
    parser.add_argument(
        "--denoiser-layers",
        type=int,
        default=DENOISER_LAYERS,
        help="the denoiser's blocks, even (default: %(default)s; the tiny preset has 2)",
    )
    parser.add_argument(
        "--swiglu-hidden",
        type=int,
        default=SWIGLU_HIDDEN,
        help="the denoiser's SwiGLU width (default: %(default)s; the tiny preset has 128)",
    )
    parser.add_argument(
        "--denoiser-width",
        type=int,
        default=DENOISER_WIDTH,
        help="the denoiser's residual width, projected from and to the D-wide latents; 0 runs the blocks on the "
        "latents themselves, as the spec does (default: %(default)s)",
    )
    parser.add_argument(
        "--prior-temperature",
        type=prior_temperature,
        default=PRIOR_TEMPERATURE,
        help="a prior temperature tau in (0, 1] to write into the config, the one every generation then starts from by default: "
        "below 1 trades diversity and few-step accuracy for text nearer the corpus (default: unset, the exact prior)",
    )
    parser.add_argument(
        "--focus-fraction",
        type=float,
        default=TrainingPlan.focus_fraction,
        help=f"share of denoiser samples at t ~ U{FOCUS_T}, the rest at U(0, 1) (default: %(default)s)",
    )
    parser.add_argument("--tokens-per-batch", type=int, default=TrainingPlan.tokens_per_batch)
    parser.add_argument(
        "--device",
        default="cpu",
        help="where to train: cpu, cuda or cuda:N; batches and noise are drawn on the CPU, so a GPU run draws the same "
        "batches, and its weights differ from the CPU's by float rounding alone (default: cpu)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: every core, %(default)s)")
    parser.add_argument("--save-every", type=float, default=120.0, help="seconds between saved states (default: %(default)s)")
    parser.add_argument(
        "--samples", type=int, default=32, help="generated samples for the word and entropy measures (default: %(default)s)"
    )
    parser.add_argument("--force", action="store_true", help="replace --out if ldlm wrote it")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    if args.threads < 1:
        parser.error(f"--threads {args.threads} is out of range: 1 or more")
    refuse_existing(args.out, args.force)
    plan = TrainingPlan(
        seed=args.seed,
        autoencoder_steps=args.autoencoder_steps,
        long_steps=args.long_steps,
        denoiser_steps=args.denoiser_steps,
        decoder_steps=args.decoder_steps,
        last_token_weight=args.last_token_weight,
        short_fraction=args.short_fraction,
        aligned_routing=args.aligned_routing,
        focus_fraction=args.focus_fraction,
        tokens_per_batch=args.tokens_per_batch,
    )
    try:
        plan.check()
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    tokenizer = TextTokenizer.gpt2()
    try:
        corpus = load_corpus(tokenizer, args.corpus)
        vocabulary = {w for text in load_documents(args.corpus).values() for w in words(text)}
    except CorpusError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        config = dataclasses.replace(
            preset(args.preset),
            denoiser_layers=args.denoiser_layers,
            swiglu_hidden=args.swiglu_hidden,
            denoiser_width=args.denoiser_width or None,
            prior_temperature=args.prior_temperature,
        )
    except ValueError as error:
        parser.error(str(error))
    try:
        device = resolve_device(args.device)
    except DeviceError as error:
        parser.error(f"--device: {error}")
    model = init_model(config, seed=args.seed).to(device)
    random_model = init_model(config, seed=args.seed).to(device)
    log = train(model, corpus, plan, args.state_dir, save_every_s=args.save_every, progress_bar=not args.quiet)
    minutes = log["train_seconds"] / 60  # every run of the recipe on this state, resumed ones included
    log["generated_text"] = text_statistics(model, tokenizer, vocabulary, args.samples, 64, args.seed)
    log["generated_text_random_weights"] = text_statistics(random_model, tokenizer, vocabulary, args.samples, 64, args.seed)
    held_out = held_out_windows(corpus.held_out, args.samples, 64, args.seed)  # as many tokens as the generated text
    log["corpus_unigram_entropy_bits"] = unigram_entropy_bits([i for window in held_out for i in window])
    log["plan"] = plan.__dict__
    log["host"] = {"machine": platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__, "device": str(device)}
    if device.type == "cuda":
        log["host"]["gpu"] = torch.cuda.get_device_name(device)
    with atomic_directory(args.out, args.force) as tmp:
        staged = save_checkpoint(model, tokenizer, tmp / "checkpoint")  # a directory of its own: its files move up
        for item in staged.iterdir():
            item.rename(tmp / item.name)
        staged.rmdir()
        (tmp / "training.json").write_text(json.dumps(log, indent=1))
        (tmp / "README.md").write_text(model_card(log, corpus, plan, model, minutes))
        write_checksums(tmp, [CONFIG_FILE, WEIGHTS_FILE, "tokenizer.json"])
    rec = log["reconstruction_held_out"]
    print(f"wrote {args.out} ({CHECKSUMS_FILE}, README.md, training.json) after {minutes:.1f} min")
    print(f"held-out reconstruction: {', '.join(f'L{k} {v:.4f}' for k, v in rec.items())}")
    den = log["denoiser_held_out"]
    print(f"held-out denoiser MSE {den['denoiser_mse']:.4f} (latent mean: {den['mean_prediction_mse']:.4f})")
    print(f"generated words in the corpus vocabulary: {log['generated_text']['words_in_corpus_vocabulary']:.3f}")
    return 0 if math.isfinite(den["denoiser_mse"]) else 1


if __name__ == "__main__":
    sys.exit(main())
