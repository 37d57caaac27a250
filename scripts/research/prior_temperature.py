#!/usr/bin/env python
"""Generated text against the prior temperature tau (x_1 ~ N(0, tau^2 I)) of a trained checkpoint: how
many of its words the corpus has, and what that costs in diversity.

For each tau of ``--temperatures``, ``--samples`` x ``--length`` tokens are generated at each seed of
``--seeds`` twice: with the checkpoint's default sampler and steps (its tuned grid where one was tuned at
that tau, else the sampler's own grid: each row names the grid it ran), and with DDIM at
``--ddim-steps`` steps, which follows the ODE closely on any grid, so its row is the model's and not the
solver's. Per row: the share of generated words (runs of letters, lower-cased) found in the corpus;
the unigram entropy of the tokens (bits, per seed and all seeds pooled); the bigram log-likelihood
under the training split's counts; and the distinct words. The held-out text gives the same measures
on as many tokens (windows of ``--length``), so pooled entropy is compared at equal size.

    python scripts/research/prior_temperature.py models/ldlm-austen-tiny --corpus . \\
        --out docs/measurements/prior-temperature-reference-2026-12-05.json

Writes the JSON and, beside it, a PNG (words in the corpus against pooled entropy, one point per tau).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ldlm.files import save_figure, write_atomically
from ldlm.pipeline import LDLMPipeline
from ldlm.sampling import GenerateRequest, resolve
from ldlm.training.corpus import load_corpus, load_documents
from ldlm.training.evaluation import bigram_log_likelihood, corpus_word_share, held_out_windows, unigram_entropy_bits, words


def text_measures(ids: list[list[int]], texts: list[str], vocabulary: set[str], train: np.ndarray, seeds: int) -> dict[str, Any]:
    """The measures of ``seeds`` equal groups of rows (ids and their texts), per group and pooled."""
    per = len(ids) // seeds
    groups = [(ids[i * per : (i + 1) * per], texts[i * per : (i + 1) * per]) for i in range(seeds)]
    shares = [corpus_word_share(group_texts, vocabulary) for _, group_texts in groups]
    entropies = [unigram_entropy_bits([i for row in group_ids for i in row]) for group_ids, _ in groups]
    every = [w for text in texts for w in words(text)]
    return {
        "words_in_corpus": round(float(np.mean(shares)), 4),
        "words_in_corpus_by_seed": [round(s, 4) for s in shares],
        "unigram_entropy_bits_by_seed": [round(e, 3) for e in entropies],
        "unigram_entropy_bits_pooled": round(unigram_entropy_bits([i for row in ids for i in row]), 3),
        "bigram_log_likelihood": round(bigram_log_likelihood(ids, train), 3),
        "distinct_words": len(set(every)),
        "words": len(every),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    pipeline = LDLMPipeline.from_checkpoint(args.checkpoint)
    corpus = load_corpus(pipeline.tokenizer, args.corpus)
    vocabulary = {w for text in load_documents(args.corpus).values() for w in words(text)}
    n, length, seeds = args.samples, args.length, range(args.seeds)
    held_ids = held_out_windows(corpus.held_out, n * len(seeds), length)
    held_out = text_measures(held_ids, [pipeline.tokenizer.decode(row) for row in held_ids], vocabulary, corpus.train, len(seeds))
    rows = []
    runs = [("default", tau, None, None) for tau in args.temperatures] + [
        ("accurate", tau, "ddim", args.ddim_steps) for tau in args.temperatures
    ]
    for kind, tau, sampler, steps in tqdm(runs, desc="temperatures", unit="run"):
        plan = resolve(GenerateRequest(n, length, steps, 0, sampler, prior_temperature=tau), pipeline.config, schedules=pipeline.schedules)
        started = time.perf_counter()
        results = [pipeline.generate(n, length, steps, seed, sampler, prior_temperature=tau) for seed in seeds]
        ids = [row for r in results for row in r.ids()]
        texts = [text for r in results for text in r.texts]
        row = {"run": kind, "prior_temperature": tau, "sampler": plan.sampler.name, "steps": plan.steps, "grid": plan.grid}
        rows.append(
            {**row, **text_measures(ids, texts, vocabulary, corpus.train, len(seeds)), "seconds": round(time.perf_counter() - started, 1)}
        )
        rows[-1]["example"] = texts[0][:300]
    return {
        "what": "generated text against the prior temperature tau (x_1 ~ N(0, tau^2 I)); words: runs of letters, lower-cased, "
        "found in the corpus's texts; entropy over token ids; bigram log-likelihood under the training split's counts",
        "checkpoint": args.checkpoint,
        "config_prior_temperature": pipeline.config.prior_temperature,
        "samples_per_seed": n,
        "length": length,
        "seeds": list(seeds),
        "held_out_text_same_size": held_out,
        "rows": rows,
        "machine": {"platform": platform.platform(), "threads": args.threads, "torch": torch.__version__},
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for kind, marker in (("default", "o"), ("accurate", "s")):
        rows = [r for r in result["rows"] if r["run"] == kind]
        x = [r["unigram_entropy_bits_pooled"] for r in rows]
        y = [100 * r["words_in_corpus"] for r in rows]
        runs = sorted({(r["steps"], r["grid"]) for r in rows})
        name = f"{rows[0]['sampler']} ({'; '.join(f'{steps} steps, {grid} grid' for steps, grid in runs)})" if rows else kind
        ax.plot(x, y, marker=marker, label=name)
        for r, xi, yi in zip(rows, x, y):
            ax.annotate(f"τ={r['prior_temperature']:g}", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=8)
    held = result["held_out_text_same_size"]
    ax.axvline(held["unigram_entropy_bits_pooled"], color="grey", linestyle=":", label="held-out text's entropy")
    ax.axhline(90, color="grey", linestyle="--", label="90% of words")
    ax.set_xlabel("unigram entropy of generated tokens, bits (all seeds pooled)")
    ax.set_ylabel("generated words found in the corpus, %")
    ax.set_title(f"{Path(result['checkpoint']).name}: the prior temperature's trade")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a trained checkpoint directory (e.g. models/ldlm-austen-tiny)")
    parser.add_argument("--corpus", type=Path, default=None, help="where the corpus's .deb files are (default: the installed packages)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON to write (the PNG goes beside it)")
    parser.add_argument(
        "--temperatures", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 0.9, 0.8, 0.7, 0.6, 0.5], help="taus in (0, 1]"
    )
    parser.add_argument("--samples", type=int, default=32, help="samples per seed (default: %(default)s)")
    parser.add_argument("--length", type=int, default=64, help="tokens per sample (default: %(default)s)")
    parser.add_argument("--seeds", type=int, default=4, help="seeds 0..N-1 (default: %(default)s)")
    parser.add_argument("--ddim-steps", type=int, default=200, help="the accurate sampler's steps (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = measure(args)
    write_atomically(args.out, json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    for row in result["rows"]:
        print(
            f"tau={row['prior_temperature']:g} {row['sampler']}@{row['steps']} ({row['grid']}): words {row['words_in_corpus']:.1%}, "
            f"entropy {row['unigram_entropy_bits_pooled']:.2f} bits, bigram {row['bigram_log_likelihood']:.2f}, distinct {row['distinct_words']}"
        )
    held = result["held_out_text_same_size"]
    print(
        f"held-out text: words {held['words_in_corpus']:.1%}, entropy {held['unigram_entropy_bits_pooled']:.2f} bits, bigram {held['bigram_log_likelihood']:.2f}"
    )


if __name__ == "__main__":
    main()
