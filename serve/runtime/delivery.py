"""Delivering what a generation step produced: previews of running samples, and the answers of
requests whose samples have all finished (the argmax ones decoded together, in one decoder call;
one that draws its tokens at a temperature decoded alone, since its settings and seed are its own)."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from ldlm.pipeline import LDLMPipeline, TextResult
from ldlm.sampling import SamplingEngine
from ldlm.serve.runtime.generation import Generation, Sample
from ldlm.serve.runtime.queueing import resolve_future

log = logging.getLogger("ldlm.serve")


class Delivery:
    def __init__(self, engine: SamplingEngine, pipeline: LDLMPipeline) -> None:
        self.engine = engine
        self.pipeline = pipeline  # its decode (through the decoder's batcher in the server)

    def previews(self, samples: list[Sample]) -> None:
        """Each running sample's x0_hat to its request's hook, every ``preview_every`` steps (not after the last).
        The hook runs on the scheduler's thread, so it must only hand the tensor on."""
        for sample in samples:
            request, state = sample.request, sample.state
            if state.done or not request.preview_every or state.step % request.preview_every:
                continue
            try:
                request.on_preview(sample.index, state.step, state.x0_hat)  # type: ignore[misc]
            except Exception as error:  # a broken hook ends its own request, with its error, never the batch
                log.exception("preview hook failed; its request ends with the error")
                resolve_future(request.future, error=error)

    def finish(self, finished: list[Sample]) -> None:
        """Record finished samples; decode the argmax requests they complete in one decoder call, and
        each request that samples its tokens (its own temperature, nucleus and seed) on its own."""
        complete: list[Generation] = []
        for sample in finished:
            request = sample.request
            request.latents[sample.index] = self.engine.latent(sample.state)
            request.remaining -= 1
            if request.remaining == 0 and not request.future.done():
                complete.append(request)
        argmax = [r for r in complete if r.decoding is None or not r.decoding.needs_logits]
        for request in complete:
            if request.decoding is not None and request.decoding.needs_logits:
                self._decode_sampled(request)
        if not argmax:
            return
        latents = [z for r in argmax for z in r.latents]
        decoded = decode_ragged(self.pipeline, latents)  # type: ignore[arg-type]
        start = 0
        for request in argmax:
            n, length = request.plan.n, request.plan.length
            rows = slice(start, start + n)
            resolve_future(
                request.future, TextResult(decoded.token_ids[rows, :length], decoded.texts[rows], decoded.lengths[rows], plan=request.plan)
            )
            start += n

    def _decode_sampled(self, request: Generation) -> None:
        """One request whose tokens are drawn from the logits; its error (e.g. no logits output) is its own."""
        try:
            result = self.pipeline.decode(torch.stack(request.latents), sampling=request.decoding)  # type: ignore[arg-type]
        except Exception as error:
            resolve_future(request.future, error=error)
            return
        result.plan = request.plan
        resolve_future(request.future, result)


def decode_ragged(pipeline: LDLMPipeline, latents: list[Tensor]) -> TextResult:
    """Latents of different lengths, each (L_i, D), in one decoder call: right-padded to the longest,
    the padding masked; each row's ``lengths`` entry is its own L_i."""
    longest = max(z.shape[0] for z in latents)
    mask = torch.zeros(len(latents), longest, dtype=torch.bool)
    for i, z in enumerate(latents):
        mask[i, : z.shape[0]] = True
    return pipeline.decode(torch.stack([F.pad(z, (0, 0, 0, longest - z.shape[0])) for z in latents]), mask)
