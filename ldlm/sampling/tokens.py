"""Choosing tokens from the token decoder's logits: argmax, or a draw at a temperature within a nucleus.

The token decoder gives a distribution over the vocabulary at every position, independently of the
other positions (all positions are decoded at once). For logits l (B, L, V) at one position:

  1. T = 0: the token is argmax l (ties: the first, as torch.argmax and the decoder graph's own).
  2. p = softmax(l / T), T > 0.
  3. Nucleus (Holtzman et al. 2019, "The Curious Case of Neural Text Degeneration"): sort p
     descending; keep the tokens whose cumulative probability *before* them is < top_p (so the
     most likely token is always kept), renormalize the kept mass.
  4. Draw the token from the renormalized nucleus, with the caller's generator (one per request,
     seeded by it, so a seed gives the same tokens).

The reported log-probabilities are the model's own, log_softmax(l) at T = 1, whatever T and top_p
chose the token (as OpenAI's and vLLM's defaults report them): what the model thinks of the token,
not of the sampling rule. Pure functions; no state is kept between calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ldlm.limits import TEMPERATURE, TOP_LOGPROBS, TOP_P


@dataclass(frozen=True)
class TokenSampling:
    """How one request's tokens are chosen: ``temperature`` 0 is argmax; ``top_p`` the nucleus mass;
    ``top_logprobs`` (None: no log-probabilities) how many alternatives to report per position;
    ``seed`` the draw's generator seed; ``given``: the tokens of the first positions, a prompt the
    sample was inpainted with, kept there (not drawn) so that their log-probabilities are the prompt's."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_logprobs: int | None = None
    seed: int = 0
    given: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        TEMPERATURE.check("temperature", self.temperature)
        TOP_P.check("top_p", self.top_p)
        if self.top_logprobs is not None:
            TOP_LOGPROBS.check("logprobs", self.top_logprobs)

    @property
    def needs_logits(self) -> bool:
        """False when the decoder's own argmax gives everything asked for."""
        return self.temperature > 0 or self.top_logprobs is not None


@dataclass
class TokenLogprobs:
    """Per position: the chosen token's log-probability and the most likely alternatives'."""

    chosen: Tensor  # (B, L) float32, log p(chosen token)
    top_ids: Tensor  # (B, L, k) int64, the k most likely tokens, most likely first
    top: Tensor  # (B, L, k) float32, their log-probabilities, descending


def sample_tokens(logits: Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> Tensor:
    """logits (B, L, V) -> token ids (B, L) int64, by steps 1-4 above (``generator``: CPU, may be None for T = 0)."""
    if temperature == 0:
        return logits.argmax(dim=-1)  # step 1
    b, length, v = logits.shape
    probs = torch.softmax(logits.float().reshape(b * length, v) / temperature, dim=-1)  # (B*L, V), step 2
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)  # (B*L, V)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly before each token
    # step 3; the most likely token has exactly 0 before it, so any top_p > 0 keeps it
    kept = torch.where(before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
    draws = torch.multinomial(kept, 1, generator=generator)  # (B*L, 1), step 4 (renormalizes)
    return order.gather(-1, draws).reshape(b, length)


def token_logprobs(logits: Tensor, token_ids: Tensor, k: int) -> TokenLogprobs:
    """logits (B, L, V), chosen ids (B, L) -> log_softmax(logits) at the ids, and the top ``k`` alternatives."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # (B, L, V)
    top, top_ids = logp.topk(k, dim=-1, sorted=True)  # (B, L, k)
    return TokenLogprobs(logp.gather(-1, token_ids[..., None])[..., 0], top_ids, top)


def choose_tokens(logits: Tensor, sampling: TokenSampling) -> tuple[Tensor, TokenLogprobs | None]:
    """One request's logits (B, L, V) -> its token ids (B, L) and, when asked for, their log-probabilities."""
    logits = logits.float().cpu()
    generator = torch.Generator().manual_seed(sampling.seed) if sampling.temperature > 0 else None
    ids = sample_tokens(logits, sampling.temperature, sampling.top_p, generator)
    if sampling.given:  # drawn first, then replaced: the other positions' draws do not depend on the prompt's
        if len(sampling.given) > ids.shape[1]:
            raise ValueError(f"{len(sampling.given)} given tokens for {ids.shape[1]} positions; allowed: up to {ids.shape[1]}")
        ids[:, : len(sampling.given)] = torch.tensor(sampling.given, dtype=ids.dtype)
    if sampling.top_logprobs is None:
        return ids, None
    return ids, token_logprobs(logits, ids, sampling.top_logprobs)
