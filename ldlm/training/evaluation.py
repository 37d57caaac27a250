"""Held-out measures of a trained model: reconstruction, denoising loss, and the text it generates."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ldlm.model.ldlm import LDLM
from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling.schedule import TangentSchedule, forward_noise
from ldlm.training.objectives import device_of, self_conditioned_x0, windows

WORD = re.compile(r"[A-Za-z]+")


@torch.no_grad()
def reconstruction_accuracy(model: LDLM, ids: np.ndarray, length: int, count: int = 64, seed: int = 0, parts: int = 1) -> list[float]:
    """Token accuracy of encode -> decode (argmax over the whole vocabulary) on windows of ``ids``,
    for each of ``parts`` equal spans of positions (one: the whole window)."""
    rng = np.random.default_rng([seed, length])
    input_ids = windows(ids, rng.integers(0, len(ids) - length, count), length).to(device_of(model))
    correct = (model.decode_tokens(model.encode_latents(input_ids)) == input_ids).float()
    return [span.mean().item() for span in correct.chunk(parts, dim=1)]


@torch.no_grad()
def last_token_accuracy(model: LDLM, windows: torch.Tensor, lengths: Iterable[int]) -> dict[int, float]:
    """For each length n: the share of ``windows`` (B, >= n) whose n-th token survives encode -> decode
    of their first n tokens. A model that keeps a token in the next position's latent loses it exactly
    where a window ends, which a whole-window accuracy averages away."""
    accuracy = {}
    for n in lengths:
        latents = model.encode_latents(windows[:, :n]) * model.latent_std + model.latent_mean
        last = model.token_decoder.hidden(model.latent_decoder(latents))[:, -1]  # decode_logits, at the last position only
        accuracy[n] = (model.token_decoder.head(last).argmax(-1) == windows[:, n - 1]).float().mean().item()
    return accuracy


@torch.no_grad()
def own_position_share(perceiver: nn.Module, inputs: torch.Tensor, nudge: float = 0.1, seed: int = 0) -> float:
    """The share of output positions p that move most when input position p moves, over ``inputs``
    (B, L, D) of a Perceiver (the latent encoder's features, or the latent decoder's latents): for each
    window, copy j has input j nudged by ``nudge`` x N(0, I), and output p's change is compared across
    the copies. 1 for a Perceiver that keeps each position at its own position; about 1/L for one that
    routes at random. A window of L tokens has only latents 0..L-1, so an encoder whose latents read
    other positions, or a decoder that reads other latents, loses the tokens whose readers lie past the end."""
    gen = torch.Generator().manual_seed(seed)
    hits = []
    for window in inputs:
        length = window.shape[0]
        nudged = window.repeat(length, 1, 1)  # (L copies, L positions, D)
        nudged[torch.arange(length), torch.arange(length)] += nudge * torch.randn(window.shape, generator=gen).to(window.device)
        change = (perceiver(nudged) - perceiver(window[None])).norm(dim=-1)  # (copy j, output p)
        hits.append(change.argmax(0) == torch.arange(length, device=window.device))
    return torch.cat(hits).float().mean().item()


@torch.no_grad()
def denoiser_evaluation(
    model: LDLM, schedule: TangentSchedule, ids: np.ndarray, length: int = 64, count: int = 64, seed: int = 0, times: int = 16
) -> dict[str, float]:
    """Held-out denoising MSE, self-conditioned as at sampling, averaged over ``times`` evenly spaced
    t in (0, 1); beside it, the MSE of predicting the latent mean (0 in the standardized space)."""
    rng = np.random.default_rng([seed, length, 1])
    z = model.encode_latents(windows(ids, rng.integers(0, len(ids) - length, count), length).to(device_of(model)))
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for t_value in (np.arange(times) + 0.5) / times:
        t = torch.full((count,), float(t_value), device=z.device)
        x_t = forward_noise(schedule, z, t, torch.randn(z.shape, generator=gen).to(z.device))
        losses.append(F.mse_loss(self_conditioned_x0(model, x_t, t), z).item())
    return {"denoiser_mse": float(np.mean(losses)), "mean_prediction_mse": z.pow(2).mean().item()}


@torch.no_grad()
def neighbour_reliance(
    model: LDLM, schedule: TangentSchedule, ids: np.ndarray, t: float, length: int = 64, count: int = 64, seed: int = 0, positions: int = 6
) -> dict[str, float]:
    """Token accuracy of the self-conditioned x0_hat from x_t at ``t``, at ``positions`` interior positions of
    held-out windows: with each window's own neighbours, and with every other position's x_t taken from
    another window (its own position kept). Equal accuracies mean a denoiser that reads its own position
    alone: its samples are tokens drawn independently, position by position, however low its loss."""
    rng = np.random.default_rng([seed, length, 2])
    input_ids = windows(ids, rng.integers(0, len(ids) - length, count), length).to(device_of(model))
    z = model.encode_latents(input_ids)
    time = torch.full((count,), float(t), device=z.device)
    x_t = forward_noise(schedule, z, time, torch.randn(z.shape, generator=torch.Generator().manual_seed(seed)).to(z.device))

    def tokens(x: torch.Tensor) -> torch.Tensor:
        return model.decode_tokens(self_conditioned_x0(model, x, time))

    chosen = np.linspace(1, length - 2, positions).round().astype(int).tolist()
    own = (tokens(x_t) == input_ids)[:, chosen].float().mean().item()
    strangers = []
    for p in chosen:
        mixed = x_t.roll(1, dims=0).clone()  # window i's neighbours are window i-1's
        mixed[:, p] = x_t[:, p]
        strangers.append((tokens(mixed)[:, p] == input_ids[:, p]).float().mean().item())
    return {"t": float(t), "with_neighbours": own, "with_other_windows_neighbours": float(np.mean(strangers))}


def bigram_log_likelihood(rows: Iterable[Iterable[int]], corpus: np.ndarray, smoothing: float = 0.1) -> float:
    """Mean log P(token | previous token) of ``rows`` under ``corpus``'s bigram counts, add-``smoothing``
    over the corpus's distinct ids: whether generated text follows the corpus's word order at all
    (tokens drawn independently by frequency score the same as shuffled text)."""
    unigrams = Counter(corpus[:-1].tolist())
    bigrams = Counter(zip(corpus[:-1].tolist(), corpus[1:].tolist()))
    distinct = len(np.unique(corpus))
    scores = [
        np.log((bigrams[(a, b)] + smoothing) / (unigrams[a] + smoothing * distinct))
        for row in rows
        for a, b in zip(list(row)[:-1], list(row)[1:])
    ]
    return float(np.mean(scores))


def words(text: str) -> list[str]:
    """Lower-cased runs of letters: what "a word of the corpus" means in the text measures."""
    return [w.lower() for w in WORD.findall(text)]


def unigram_entropy_bits(ids: list[int] | np.ndarray) -> float:
    counts = np.array(list(Counter(np.asarray(ids).tolist()).values()), dtype=np.float64)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def corpus_word_share(texts: Iterable[str], vocabulary: set[str]) -> float:
    """The share of the words of ``texts`` that ``vocabulary`` (the corpus's words) has; 0 for no words."""
    found = [w in vocabulary for text in texts for w in words(text)]
    return sum(found) / max(1, len(found))


def held_out_windows(ids: np.ndarray, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """``n`` windows of ``length`` tokens of ``ids`` at seeded random starts: text to measure beside
    ``n`` generated samples of that length (entropy grows with the number of tokens it is taken over)."""
    starts = np.random.default_rng(seed).integers(0, len(ids) - length, n)
    return [ids[s : s + length].tolist() for s in starts]


def text_statistics(
    model: LDLM, tokenizer: TextTokenizer, vocabulary: set[str], n: int, length: int, seed: int, prior_temperature: float | None = None
) -> dict[str, Any]:
    """Generated text under the default sampler and steps, at ``prior_temperature`` (default: the
    config's): the share of its words that the corpus has, and its unigram entropy (bits per token)."""
    result = LDLMPipeline(model, tokenizer, device_of(model)).generate(n, length, seed=seed, prior_temperature=prior_temperature)
    generated = [w for text in result.texts for w in words(text)]
    return {
        "samples": n,
        "length": length,
        "prior_temperature": model.config.prior_temperature_for(prior_temperature),
        "words": len(generated),
        "words_in_corpus_vocabulary": corpus_word_share(result.texts, vocabulary),
        "unigram_entropy_bits": unigram_entropy_bits([i for row in result.ids() for i in row]),
        "examples": result.texts[:4],
    }
