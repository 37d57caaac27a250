#!/usr/bin/env python
"""Whether a checkpoint keeps the last token of a window at every length: held-out windows cut at each
length 2..128, encoded and decoded, the last token compared. Writes JSON (per checkpoint: every
length's accuracy, the worst lengths, the mean, the lengths below 50%, and the share of latents that move most
with their own position's feature: ldlm/training/evaluation.py's own_position_share).

    python scripts/research/last_token_accuracy.py models/ldlm-austen-tiny [OTHER_CHECKPOINT ...] --out result.json

The windows are tests/data/reference-held-out-windows.json (the reference corpus's held-out text,
written by tests/data/make_reference_held_out.py); a whole-window accuracy averages away a model that
keeps some position's token in the next position's latent, and so loses it where a window ends there.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ldlm.files import write_atomically
from ldlm.model.checkpoint import load_checkpoint
from ldlm.training.evaluation import last_token_accuracy, own_position_share
from ldlm.training.objectives import standard_features

WINDOWS = Path(__file__).resolve().parents[2] / "tests" / "data" / "reference-held-out-windows.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", type=Path, help="checkpoint directories")
    parser.add_argument("--out", type=Path, required=True, help="JSON path to write")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = json.loads(WINDOWS.read_text())
    windows = torch.tensor(data["windows"])
    results = {}
    for checkpoint in args.checkpoints:
        model, _ = load_checkpoint(checkpoint)
        accuracy = last_token_accuracy(model, windows, range(2, windows.shape[1] + 1))
        worst = sorted(accuracy, key=accuracy.__getitem__)[:5]
        share = own_position_share(model.latent_encoder, standard_features(model, windows, torch.ones_like(windows)))
        broken = [n for n, a in accuracy.items() if a < 0.5]
        results[str(checkpoint)] = {
            "mean": sum(accuracy.values()) / len(accuracy),
            "own_position_share": share,
            "lengths_below_50pct": broken,
            "worst": {n: accuracy[n] for n in worst},
            "by_length": accuracy,
        }
        print(f"{checkpoint}: {len(broken)} lengths below 50%, latents reading their own position {share:.3f}")
        print(f"{checkpoint}: mean {results[str(checkpoint)]['mean']:.4f}, worst {', '.join(f'L{n} {accuracy[n]:.2f}' for n in worst)}")
    report = {"windows": f"{windows.shape[0]} x {windows.shape[1]} tokens: {data['source']}", "checkpoints": results}
    write_atomically(args.out, json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
