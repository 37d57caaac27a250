"""The pipeline: encode, decode, reconstruct and generate on top of the three inference graphs.

The graphs are anything with ``encode_latents``, ``denoise`` and ``decode_tokens``: the eager
``LDLM`` itself, or ONNX Runtime / TensorRT engines behind the same three methods (ldlm.serve),
so every backend shares this one implementation and its results API. Inputs are checked here,
once, at the boundary; the graphs trust their tensors.

Shape buckets: with ``buckets`` set, sequences are right-padded to the next bucket length and the
padding is masked, which keeps the set of shapes an engine sees small without changing results.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor, nn

from ldlm.buckets import bucket_for
from ldlm.model.checkpoint import load_checkpoint
from ldlm.model.config import LDLMConfig
from ldlm.model.tokenizer import TextTokenizer
from ldlm.sampling import GenerateRequest, SamplingEngine, SamplingPlan, resolve, run_lockstep
from ldlm.sampling.schedule import TangentSchedule
from ldlm.sampling.tokens import TokenLogprobs, TokenSampling, choose_tokens
from ldlm.sampling.tuned_grids import TunedSchedules, checkpoint_schedules


def _preview(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def check_length(length: int, max_seq_len: int, name: str = "length") -> None:
    if not isinstance(length, int) or not 1 <= length <= max_seq_len:
        raise ValueError(f"{name}={length!r} is out of range; allowed: 1..{max_seq_len} (config max_seq_len)")


@dataclass
class EncodeResult:
    latents: Tensor  # (B, L, D) standardized latents
    attention_mask: Tensor  # (B, L) bool, True at real tokens (padding on the right)
    token_ids: Tensor  # (B, L) int64, padded with eos


@dataclass
class TextResult:
    token_ids: Tensor  # (B, L) int64; row i is real up to lengths[i], what the decoder made of padding after it
    texts: list[str]  # detokenized, cut at the first end-of-text token
    lengths: list[int]  # real (unpadded) positions per row
    logprobs: TokenLogprobs | None = None  # when decoded with TokenSampling.top_logprobs set
    plan: SamplingPlan | None = None  # a generation's resolved plan (what ran); None for reconstructions

    def ids(self) -> list[list[int]]:
        """The token ids of each text without its padded positions: what a caller should return."""
        return [row[:n].tolist() for row, n in zip(self.token_ids, self.lengths)]


class InferenceGraphs(Protocol):
    """The three graphs, in the standardized latent space; masks are (B, L) bool, True = real."""

    def encode_latents(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor: ...
    def denoise(self, x_t: Tensor, t: Tensor, x0_prev: Tensor, mask: Tensor | None) -> Tensor: ...  # None: no padding
    def decode_tokens(self, latents: Tensor, mask: Tensor) -> Tensor: ...

    # optional: ``decode_logits(latents, mask) -> (B, L, V)``, for ``decode(..., sampling=...)``


class LDLMPipeline:
    def __init__(
        self,
        graphs: InferenceGraphs,
        tokenizer: TextTokenizer,
        device: str | torch.device = "cpu",
        config: LDLMConfig | None = None,
        buckets: Sequence[int] = (),
        noise_device: str | torch.device | None = None,
        schedules: TunedSchedules | None = None,
    ) -> None:
        """``schedules``: the checkpoint's tuned step grids (used by default where one is tuned; see
        ldlm/sampling/tuned_grids.py)."""
        if isinstance(graphs, nn.Module):
            graphs = graphs.to(device).eval()
        self.graphs = graphs
        self.tokenizer = tokenizer
        self.config: LDLMConfig = config if config is not None else graphs.config  # type: ignore[attr-defined]
        self.device = torch.device(device)
        self.schedule = TangentSchedule(self.config.schedule_d, self.config.beta_clip_t)
        # noise_device: where noise is drawn (default: ``device``; "cpu" gives a GPU run the CPU run's noise)
        self.engine = SamplingEngine(self.schedule, self.config.decode_final, self.device, noise_device)
        self.noise_device = self.engine.noise_device
        self.schedules = schedules
        bad = [b for b in buckets if not 1 <= b <= self.config.max_seq_len]
        if bad:
            raise ValueError(f"buckets {bad} are out of range; allowed: 1..{self.config.max_seq_len} (config max_seq_len)")
        self.buckets = sorted(set(buckets))

    @classmethod
    def from_checkpoint(cls, path: str | os.PathLike[str], device: str | torch.device = "cpu") -> LDLMPipeline:
        model, tokenizer = load_checkpoint(path, device)
        return cls(model, tokenizer, device, schedules=checkpoint_schedules(path))

    def bucket_length(self, length: int) -> int:
        """The padded length for a batch whose longest sequence has ``length`` positions."""
        return bucket_for(length, self.buckets)

    # --- input checks -------------------------------------------------------------------------

    def check_length(self, length: int, name: str = "length") -> None:
        check_length(length, self.config.max_seq_len, name)

    def check_token_ids(self, ids: Sequence[Sequence[int]]) -> None:
        """Ids to encode index GPT-2's token table, so they must be below its size (the LDLM
        vocabulary's extra mask token has no GPT-2 embedding)."""
        v = self.config.gpt2_vocab_size
        if len(ids) == 0:
            raise ValueError("no sequences given; allowed: at least one")
        for i, row in enumerate(ids):
            self.check_length(len(row), f"len(ids[{i}])")
            for j, token in enumerate(row):
                if not 0 <= int(token) < v:
                    raise ValueError(f"ids[{i}][{j}]={int(token)} is out of range; allowed: [0, {v}) (gpt2_vocab_size)")

    def text_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Texts -> GPT-2 token ids, each at most max_seq_len long, named as the caller knows it (texts[i])."""
        ids = self.tokenizer.encode(texts)
        for i, row in enumerate(ids):
            if len(row) > self.config.max_seq_len:
                raise ValueError(f"texts[{i}] is {len(row)} tokens long; allowed: 1..{self.config.max_seq_len} tokens (config max_seq_len)")
        return ids

    # --- the four jobs ----------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, inputs: Sequence[str] | Sequence[Sequence[int]]) -> EncodeResult:
        """Texts or token-id lists -> standardized latents, right-padded to the longest input."""
        if isinstance(inputs, str):  # a bare string is a sequence of one-character texts: never what was meant
            raise TypeError(
                f"inputs is the string {_preview(inputs)}; allowed: a list of texts or token-id lists, e.g. [{_preview(inputs)}]"
            )
        if len(inputs) == 0:
            raise ValueError("no inputs given; allowed: at least one text or id list")
        ids = self.text_ids(inputs) if isinstance(inputs[0], str) else [list(map(int, r)) for r in inputs]  # type: ignore[arg-type]
        self.check_token_ids(ids)
        length = max(len(row) for row in ids)
        padded = self.bucket_length(length)
        token_ids = torch.full((len(ids), padded), self.config.eos_token_id, dtype=torch.long)
        mask = torch.zeros((len(ids), padded), dtype=torch.bool)
        for i, row in enumerate(ids):
            token_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = True
        token_ids, mask = token_ids.to(self.device), mask.to(self.device)
        latents = self.graphs.encode_latents(token_ids, mask)
        return EncodeResult(latents=latents[:, :length], attention_mask=mask[:, :length], token_ids=token_ids[:, :length])

    @torch.inference_mode()
    def decode(self, latents: Tensor, attention_mask: Tensor | None = None, sampling: TokenSampling | None = None) -> TextResult:
        """Standardized latents (B, L, D) -> token ids and texts. Padded positions are dropped.

        ``sampling`` (default: argmax, as the decoder graph's own ``token_ids``): a temperature, nucleus
        and seed to draw the tokens from the decoder's logits, and log-probabilities to report; it needs
        graphs with ``decode_logits`` (an export with ``ldlm export --with-logits``)."""
        d = self.config.d_model
        if latents.ndim != 3 or latents.shape[-1] != d:
            raise ValueError(f"latents have shape {tuple(latents.shape)}; allowed: (B, L, {d})")
        b, length, _ = latents.shape
        self.check_length(length, "latents.shape[1]")
        if attention_mask is None:
            attention_mask = torch.ones(b, length, dtype=torch.bool)
        if tuple(attention_mask.shape) != (b, length):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}; allowed: ({b}, {length})")
        padded = self.bucket_length(length)
        latents = torch.nn.functional.pad(latents.to(self.device), (0, 0, 0, padded - length))
        mask = torch.nn.functional.pad(attention_mask.to(self.device).bool(), (0, padded - length))
        logprobs = None
        if sampling is None or not sampling.needs_logits:
            token_ids = self.graphs.decode_tokens(latents, mask).cpu()[:, :length]
        else:
            decode_logits = getattr(self.graphs, "decode_logits", None)
            if decode_logits is None or not getattr(self.graphs, "has_logits", True):
                raise ValueError(
                    f"sampling={sampling} needs the decoder's logits, which these graphs do not output; "
                    "export with `ldlm export --with-logits` (or serve a checkpoint on a torch backend)"
                )
            # cut before drawing: the draws (and so the text) must not depend on the bucket
            token_ids, logprobs = choose_tokens(decode_logits(latents, mask)[:, :length], sampling)
        lengths = mask.sum(dim=1).tolist()
        texts = [self.tokenizer.decode(row[:n].tolist()) for row, n in zip(token_ids, lengths)]
        return TextResult(token_ids=token_ids, texts=texts, lengths=lengths, logprobs=logprobs)

    def reconstruct(self, texts: Sequence[str] | Sequence[Sequence[int]]) -> TextResult:
        """Texts (or their token ids) -> latents -> texts: the autoencoder's round trip. ``texts`` is a
        list, even of one text."""
        encoded = self.encode(texts)
        return self.decode(encoded.latents, encoded.attention_mask)

    @torch.inference_mode()
    def generate(
        self,
        n: int,
        length: int,
        steps: int | None = None,
        seed: int | None = None,
        sampler: str | None = None,
        t_min: float | None = None,
        progress: bool = False,
        prompt: str | Sequence[int] | None = None,
        grid: str | None = None,
        prior_temperature: float | None = None,
        prompt_strength: float | None = None,
    ) -> TextResult:
        """Sample n sequences of ``length`` tokens with ``steps`` denoiser calls each.

        ``sampler`` is one of ``ldlm.model.config.SAMPLERS`` (default: the config's ``default_sampler``).
        Every sampler but ``"sde"`` is deterministic given the seed (the prior is still seeded);
        ``"sde"`` draws fresh noise every step, also from the seed. ``prompt`` (a text or its token
        ids, shorter than ``length``): every sample starts with it, by prefix inpainting
        (ldlm/sampling/loop.py), and its text is the prompt's followed by the continuation. ``grid``:
        a kind of ``ldlm.sampling.schedule.time_grid`` or ``"tuned"`` (default: the tuned grid where the checkpoint
        has one for this sampler and step count, else the sampler's own). ``prior_temperature`` in (0, 1]:
        the prior's standard deviation (default: the config's, else 1); below 1 trades diversity for text
        nearer the training data. ``prompt_strength`` (range: ``ldlm.limits.PROMPT_STRENGTH``): the prompt's guidance weight (default 1:
        inpainting alone; other values denoise each sample a second time blind to the prompt and extrapolate,
        ldlm/sampling/loop.py); without a prompt it changes nothing. Whatever is left out (None) is filled
        in by ``ldlm.sampling.resolve``, and the result's ``plan`` says what ran.
        """
        # "" (or no ids) is no prompt, as on every other path
        ids = None if not prompt else self.text_ids([prompt])[0] if isinstance(prompt, str) else [int(i) for i in prompt]
        prefix = None if ids is None else self.prompt_latents(ids, length)
        request = GenerateRequest(n, length, steps, seed, sampler, t_min, grid, prior_temperature, prompt_strength)
        plan = resolve(request, self.config, schedules=self.schedules)
        result = self.decode(self.run_plan(plan, progress, prefix))
        result.plan = plan
        return result if ids is None else self.keep_prompt(result, ids)

    def keep_prompt(self, result: TextResult, ids: Sequence[int]) -> TextResult:
        """``result`` with its first positions the prompt's own tokens, as given: what the decoder makes of the
        prompt's latents is not the model's answer, and a prompt must come back verbatim."""
        return keep_prompt(result, ids, self.tokenizer)

    def prompt_latents(self, prompt: str | Sequence[int], length: int) -> Tensor:
        """A prompt's latents (P, D) to inpaint, P < ``length`` (the continuation needs a position)."""
        ids = self.text_ids([prompt])[0] if isinstance(prompt, str) else [int(i) for i in prompt]
        if not 1 <= len(ids) < length:
            raise ValueError(f"the prompt is {len(ids)} tokens long; allowed: 1..{length - 1} tokens (fewer than length={length})")
        return self.encode([ids]).latents[0]

    def sample_latents(
        self,
        n: int,
        length: int,
        steps: int | None = None,
        seed: int | None = None,
        sampler: str | None = None,
        t_min: float | None = None,
        progress: bool = False,
        prefix: Tensor | None = None,
        grid: str | None = None,
        prior_temperature: float | None = None,
        prompt_strength: float | None = None,
    ) -> Tensor:
        """The standardized latents (n, length, D) that ``generate`` decodes, all samples in lockstep."""
        request = GenerateRequest(n, length, steps, seed, sampler, t_min, grid, prior_temperature, prompt_strength)
        return self.run_plan(resolve(request, self.config, schedules=self.schedules), progress, prefix)

    def run_plan(self, plan: SamplingPlan, progress: bool = False, prefix: Tensor | None = None) -> Tensor:
        """The standardized latents (n, length, D) of a resolved ``plan``, all samples in lockstep."""
        states = self.engine.start(plan, self.config.d_model, prefix)
        with torch.inference_mode():
            return run_lockstep(self.engine, states, self.graphs.denoise, self.bucket_length(plan.length), progress)


def keep_prompt(result: TextResult, ids: Sequence[int], tokenizer: TextTokenizer) -> TextResult:
    """``LDLMPipeline.keep_prompt`` with the tokenizer given (the server's streams hold one, not a pipeline)."""
    token_ids = result.token_ids.clone()
    token_ids[:, : len(ids)] = torch.tensor(list(ids), dtype=token_ids.dtype)
    texts = [tokenizer.decode(row[:n].tolist()) for row, n in zip(token_ids, result.lengths)]
    return TextResult(token_ids, texts, result.lengths, result.logprobs, result.plan)
