#!/usr/bin/env python
"""Whether a prompt steers what follows it: held-out windows cut into pieces of ``--length`` tokens, the first
``--prompt-tokens`` of each the prompt, the rest generated under several ways of conditioning, each run at the
same seeds as unprompted samples. Writes JSON.

    python scripts/research/prompt_steering.py models/ldlm-austen-tiny \\
        --out docs/measurements/prompt-steering-reference-2026-12-06.json

Per method, over the continuation's positions (after the prompt):
- ``equal_to_unprompted``: the share of tokens equal to the unprompted sample of the same seed (lower: the
  prompt moves more; also over the first four positions). Its floor, ``floor_two_unprompted_seeds``, is two unprompted seeds' agreement. Fresh
  noise alone lowers it, so it says nothing about following the prompt.
- ``true_next``: the corpus's own continuation under the token decoder's distribution at the final latent:
  mean log-probability, median rank, top-1 and top-10 shares. The decoder of a sampled latent is nearly a
  point mass, so its log-probabilities mostly measure how sure it is; hence also
- ``own_minus_other_logprob``: the mean log-probability of the window's own continuation minus that of the
  other windows' continuations at the same positions (all positions, and the first four): a decoder that is
  merely less sure raises both alike. 0 for a sample that knows nothing of its prompt; ``own_above_other``
  is the share of other windows whose continuation scores below the window's own (0.5 by chance). Each with
  its standard error over the samples.
- ``in_held_out_text``: the share of generated tokens found anywhere in the held-out windows, a guard
  against conditioning that stops writing the corpus's words.
- ``denoiser_rows``: denoiser evaluations per sample (a guided step evaluates two rows).

Methods: ``inpainting`` (the engine's default: the prompt's latents forward-noised to each step's time);
the same at twice the steps (the guided methods' denoiser work); ``clean self-conditioning`` (the prompt's
clean latents as the self-conditioning input at its positions); ``clean prompt in x_t`` (the prompt held
clean, not noised); ``RePaint`` (each step taken, noised back up to its start and taken again,
Lugmayr et al. 2022); and prompt guidance at each ``--strengths`` weight (ldlm/sampling/loop.py, the
plan's ``prompt_strength``). ``true latents`` decodes the windows' own encoded latents: what the measures
read for a continuation that follows its prompt exactly. ``adopt`` names the methods that at most double
the denoiser rows, halve inpainting's equal share, and raise its own-minus-other log-probability by more
than two standard errors with a lower median rank of the true next tokens.

The windows are tests/data/reference-held-out-windows.json (the reference corpus's held-out text).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ldlm.files import write_atomically
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling import DenoiseFn, GenerateRequest, NoiseStream, SampleState, resolve, run_lockstep
from ldlm.sampling.schedule import per_sample

WINDOWS = Path(__file__).resolve().parents[2] / "tests" / "data" / "reference-held-out-windows.json"
NEAR = 4  # the continuation's first positions, where a prompt's neighbours should count most
DECODE_CHUNK = 8  # samples decoded at a time: 8 x 48 positions x GPT-2's vocabulary is 77 MB of logits


@dataclass
class Setup:
    pipeline: LDLMPipeline
    ids: Tensor  # (S, L) each sample's window (a window appears once per repeat)
    window: Tensor  # (S,) the window index of each sample
    prefixes: Tensor  # (S, P, D) each sample's prompt latents
    prompt: int  # P
    steps: int | None

    @property
    def length(self) -> int:
        return self.ids.shape[1]


def held_out_pieces(length: int) -> tuple[Tensor, str, set[int]]:
    """The held-out windows cut into non-overlapping pieces of ``length`` tokens (W, length), their source, and
    every token id they hold."""
    data = json.loads(WINDOWS.read_text())
    windows = torch.tensor(data["windows"])
    pieces = [windows[:, start : start + length] for start in range(0, windows.shape[1] - length + 1, length)]
    return torch.cat(pieces), data["source"], set(windows.flatten().tolist())


def states_for(setup: Setup, seeds: list[int], prompted: bool, steps: int | None, strength: float | None = None) -> list[SampleState]:
    """One state per sample at its own seed, conditioned on its own prompt where ``prompted``."""
    pipeline, states = setup.pipeline, []
    for i, seed in enumerate(seeds):
        request = GenerateRequest(1, setup.length, steps, seed, prompt_strength=strength)
        plan = resolve(request, pipeline.config, schedules=pipeline.schedules)
        states += pipeline.engine.start(plan, pipeline.config.d_model, setup.prefixes[i] if prompted else None)
    return states


class CountingDenoiser:
    """The pipeline's denoiser, counting the rows it evaluates; ``edit`` may change its inputs first."""

    def __init__(self, pipeline: LDLMPipeline, edit: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None) -> None:
        self.denoise, self.edit, self.rows = pipeline.graphs.denoise, edit, 0

    def __call__(self, x: Tensor, t: Tensor, x0_prev: Tensor, mask: Tensor) -> Tensor:
        if self.edit is not None:
            x, x0_prev = self.edit(x, x0_prev)
        self.rows += x.shape[0]
        return self.denoise(x, t, x0_prev, mask)


def repaint_lockstep(setup: Setup, states: list[SampleState], denoise: DenoiseFn, seeds: list[int]) -> Tensor:
    """RePaint with one resample per step: each step from t to t' is taken, its result noised back to t
    (x_t = a x_t' + sqrt(sigma_t^2 - a^2 sigma_t'^2) eps, a = alpha_t / alpha_t'), and the step taken again
    from there; the step's past is restored first, so a multistep sampler does not see the same time twice."""
    engine, schedule = setup.pipeline.engine, setup.pipeline.schedule
    streams = [NoiseStream(seed ^ 2, (setup.length, states[0].prior.shape[1])) for seed in seeds]
    table = engine.table(setup.length)
    table.run(states)
    slots = [s.slot for s in states]
    index, rows = torch.tensor(slots), table.state
    for _ in range(states[0].steps):
        saved = {name: rows[name][index].clone() for name in ("past_x0", "past_lam", "x_prev")}
        table.steps[slots] += 1  # the first pass must not finish a sample: its step is taken again
        table.step(denoise)
        table.steps[slots] -= 1
        for state, stream in zip(states, streams):
            k = int(table.k[state.slot])
            t, t_next = state.times[k - 1 : k], state.times[k : k + 1]
            a = schedule.alpha(t) / schedule.alpha(t_next)
            spread = (schedule.sigma(t) ** 2 - a**2 * schedule.sigma(t_next) ** 2).clamp_min(0).sqrt()
            x = rows["x"][state.slot, : setup.length]
            rows["x"][state.slot, : setup.length] = (per_sample(a) * x[None] + per_sample(spread) * stream.draw()[None])[0]
            table.k[state.slot] = k - 1
        for name, value in saved.items():
            rows[name][index] = value
        table.step(denoise)
    return torch.stack([engine.latent(s) for s in states])


def run_method(setup: Setup, method: dict[str, Any], seeds: list[int]) -> tuple[Tensor, float]:
    """A method's final latents (S, L, D) at ``seeds`` and its denoiser rows per sample."""
    p, prefixes = setup.prompt, setup.prefixes

    def clean_self_conditioning(x: Tensor, x0_prev: Tensor) -> tuple[Tensor, Tensor]:
        return x, torch.cat([prefixes.to(x0_prev.dtype), x0_prev[:, p:]], 1)

    def clean_prompt(x: Tensor, x0_prev: Tensor) -> tuple[Tensor, Tensor]:
        return torch.cat([prefixes.to(x.dtype), x[:, p:]], 1), x0_prev

    edit = {"self_conditioning": clean_self_conditioning, "x_t": clean_prompt}.get(method.get("clean", ""))
    denoise = CountingDenoiser(setup.pipeline, edit)
    steps = method.get("steps", setup.steps)
    states = states_for(setup, seeds, method.get("prompted", True), steps, method.get("strength"))
    with torch.inference_mode():
        if method.get("repaint"):
            latents = repaint_lockstep(setup, states, denoise, seeds)
        else:
            latents = run_lockstep(setup.pipeline.engine, states, denoise)
    return latents, denoise.rows / len(seeds)


@dataclass
class Decoded:
    tokens: Tensor  # (S, L) argmax
    logprobs: Tensor  # (S, W, C) log-probability of window w's continuation at sample s's positions
    ranks: Tensor  # (S, C) rank of the sample's own continuation's tokens (0: the decoder's first choice)


def decode(setup: Setup, latents: Tensor, pieces: Tensor) -> Decoded:
    """What the token decoder makes of ``latents``: its tokens, and every window's continuation's log-probabilities."""
    decode_logits = setup.pipeline.graphs.decode_logits  # type: ignore[attr-defined]  # the checkpoint's eager LDLM has it
    p = setup.prompt
    tokens, logprobs, ranks = [], [], []
    with torch.inference_mode():
        for start in range(0, latents.shape[0], DECODE_CHUNK):
            chunk = latents[start : start + DECODE_CHUNK]
            log_p = decode_logits(chunk, torch.ones(chunk.shape[:2], dtype=torch.bool)).float().log_softmax(-1)
            tokens.append(log_p.argmax(-1))
            after = log_p[:, p:]  # (b, C, V)
            every = after.gather(-1, pieces[None, :, p:].expand(len(chunk), -1, -1).transpose(1, 2)).transpose(1, 2)
            logprobs.append(every)  # (b, W, C)
            own = after.gather(-1, setup.ids[start : start + DECODE_CHUNK, p:, None])
            ranks.append((after > own).sum(-1))
    return Decoded(torch.cat(tokens), torch.cat(logprobs), torch.cat(ranks))


def mean_and_error(values: Tensor) -> dict[str, float]:
    """Per-sample values' mean and its standard error."""
    return {"mean": round(values.mean().item(), 4), "standard_error": round((values.std() / values.numel() ** 0.5).item(), 4)}


def measures(setup: Setup, decoded: Decoded, unprompted: Tensor | None, held_out: set[int]) -> dict[str, Any]:
    """Every measure of one method's decoded samples (module docstring)."""
    p, s = setup.prompt, torch.arange(len(setup.window))
    own_lp = decoded.logprobs[s, setup.window]  # (S, C)
    others = torch.ones_like(decoded.logprobs[..., 0], dtype=torch.bool)
    others[s, setup.window] = False  # (S, W)

    def contrast(positions: slice) -> dict[str, float]:
        per = decoded.logprobs[..., positions].mean(-1)  # (S, W)
        own = own_lp[:, positions].mean(-1)
        other = (per * others).sum(1) / others.sum(1)
        return mean_and_error(own - other)

    whole = decoded.logprobs.mean(-1)
    above = ((whole[s, setup.window][:, None] > whole) & others).sum(1) / others.sum(1)
    after = decoded.tokens[:, p:]
    equal = None if unprompted is None else (after == unprompted[:, p:]).float()
    return {
        "equal_to_unprompted": None if equal is None else round(equal.mean().item(), 4),
        "equal_to_unprompted_first_4": None if equal is None else round(equal[:, :NEAR].mean().item(), 4),
        "true_next": {
            "mean_logprob": round(own_lp.mean().item(), 3),
            "median_rank": int(decoded.ranks.float().median().item()),
            "top1": round((decoded.ranks == 0).float().mean().item(), 4),
            "top10": round((decoded.ranks < 10).float().mean().item(), 4),
        },
        "own_minus_other_logprob": contrast(slice(None)),
        "own_minus_other_logprob_first_4": contrast(slice(0, NEAR)),
        "own_above_other": mean_and_error(above.float()),
        "in_held_out_text": round(sum(int(t) in held_out for t in after.flatten().tolist()) / after.numel(), 4),
    }


def methods(strengths: list[float], steps: int) -> dict[str, dict[str, Any]]:
    """Every way of conditioning measured (module docstring); ``steps``: the default plan's."""
    out: dict[str, dict[str, Any]] = {
        "inpainting": {},
        "inpainting, twice the steps": {"steps": 2 * steps},
        "clean self-conditioning": {"clean": "self_conditioning"},
        "clean prompt in x_t": {"clean": "x_t"},
        "RePaint, one resample per step": {"repaint": True},
    }
    for strength in strengths:
        out[f"prompt guidance, strength {strength:g}"] = {"strength": strength}
    return out


def qualifies(result: dict[str, Any], baseline: dict[str, Any]) -> bool:
    """The adoption rule: at most twice inpainting's denoiser rows, half its equal share, and a better following of
    the prompt (own-minus-other log-probability up by more than two standard errors, a lower median true-next rank)."""
    gain = result["own_minus_other_logprob"]["mean"] - baseline["own_minus_other_logprob"]["mean"]
    noise = 2 * max(result["own_minus_other_logprob"]["standard_error"], baseline["own_minus_other_logprob"]["standard_error"])
    return (
        result["denoiser_rows"] <= 2 * baseline["denoiser_rows"]
        and result["equal_to_unprompted"] <= baseline["equal_to_unprompted"] / 2
        and gain > noise
        and result["true_next"]["median_rank"] < baseline["true_next"]["median_rank"]
    )


def unprompted_runs(
    setup: Setup, pieces: Tensor, seeds: list[int], steps: int, held_out: set[int]
) -> tuple[dict[str, Any], dict[int, Tensor], float]:
    """The unprompted samples at ``steps`` and twice as many (each the reference of the prompted runs at as many
    steps): their measures and tokens, and the floor, two unprompted seeds' agreement at ``steps``."""
    results, tokens = {}, {}
    for count in (steps, 2 * steps):
        latents, rows = run_method(setup, {"prompted": False, "steps": count}, seeds)
        decoded = decode(setup, latents, pieces)
        tokens[count] = decoded.tokens
        results[f"unprompted, {count} steps"] = {**measures(setup, decoded, None, held_out), "denoiser_rows": rows}
    other, _ = run_method(setup, {"prompted": False, "steps": steps}, [seed + len(seeds) for seed in seeds])
    floor = measures(setup, decode(setup, other, pieces), tokens[steps], held_out)["equal_to_unprompted"]
    return results, tokens, floor


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    pipeline = LDLMPipeline.from_checkpoint(args.checkpoint)
    pieces, source, held_out = held_out_pieces(args.length)
    ids, window = pieces.repeat(args.repeats, 1), torch.arange(len(pieces)).repeat(args.repeats)
    prefixes = pipeline.encode(ids[:, : args.prompt_tokens].tolist()).latents
    setup = Setup(pipeline, ids, window, prefixes, args.prompt_tokens, None)
    seeds = [args.seed + i for i in range(len(ids))]
    plan = resolve(GenerateRequest(1, args.length), pipeline.config, schedules=pipeline.schedules)
    results, unprompted, floor = unprompted_runs(setup, pieces, seeds, plan.steps, held_out)
    for name, method in methods(args.strengths, plan.steps).items():
        started = time.perf_counter()
        latents, rows = run_method(setup, method, seeds)
        decoded = decode(setup, latents, pieces)
        found = measures(setup, decoded, unprompted[method.get("steps", plan.steps)], held_out)
        results[name] = {**found, "denoiser_rows": rows, "seconds": round(time.perf_counter() - started, 1)}
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    results["true latents"] = measures(setup, decode(setup, pipeline.encode(ids.tolist()).latents, pieces), None, held_out)
    adopt = [
        name for name in methods(args.strengths, plan.steps) if name != "inpainting" and qualifies(results[name], results["inpainting"])
    ]
    return {
        "checkpoint": str(args.checkpoint),
        "windows": f"{len(pieces)} held-out pieces of {args.length} tokens x {args.repeats} seeds = {len(ids)} samples ({source})",
        "prompt_tokens": args.prompt_tokens,
        "continuation_tokens": args.length - args.prompt_tokens,
        "plan": plan.summary(),
        "seeds": f"{seeds[0]}..{seeds[-1]}; floor: {seeds[0] + len(ids)}..{seeds[-1] + len(ids)}",
        "floor_two_unprompted_seeds": floor,
        "methods": results,
        "adopt": adopt,
        "host": {"machine": platform.machine(), "threads": args.threads, "torch": torch.__version__},
    }


def strengths(text: str) -> list[float]:
    return [float(value) for value in text.split(",") if value]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="checkpoint directory")
    parser.add_argument("--out", type=Path, required=True, help="JSON path to write")
    parser.add_argument("--length", type=int, default=48, help="tokens per piece, prompt included (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="the prompt's tokens, fewer than --length (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=2, help="seeds per piece (default: %(default)s)")
    parser.add_argument(
        "--seed", type=int, default=0, help="the first sample's seed; the floor's follow the samples' (default: %(default)s)"
    )
    parser.add_argument(
        "--strengths", type=strengths, default=[0.0, 1.5, 2.0, 3.0], help="prompt guidance weights, comma-separated (default: 0,1.5,2,3)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    args = parser.parse_args(argv)
    if not 1 <= args.prompt_tokens < args.length <= 128:
        parser.error(f"--prompt-tokens {args.prompt_tokens} and --length {args.length}: allowed 1 <= prompt tokens < length <= 128")
    report = measure(args)
    write_atomically(args.out, json.dumps(report, indent=1) + "\n")
    print(f"adopt: {report['adopt'] or 'nothing'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
