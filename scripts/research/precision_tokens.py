#!/usr/bin/env python
"""Which reduced precision keeps a trained checkpoint's tokens: bf16 and fp16 against fp32, as served.

Each precision runs the checkpoint's own modules the way the torch backends serve them (``prepare_model``: the
Linear layers' weights cast, matmuls and attention in the low precision under autocast, the residual stream, every
LayerNorm and RMSNorm and the vocabulary head in FP32), generating ``--samples`` x ``--length`` tokens at each seed
of ``--seeds`` with the checkpoint's default sampler and steps; the share of token ids equal to fp32's at the same
seed is the measure (the sampler's noise is the same stream in every run). Plain ``torch.autocast`` on the FP32
model (the vocabulary head in the low precision too) is measured beside it for comparison. Random weights hide the difference: run it on a trained checkpoint.

    python scripts/research/precision_tokens.py models/ldlm-austen-tiny \\
        --out docs/measurements/precision-tokens-reference-cpu-2026-12-06.json

On a GPU pass ``--device cuda``; the CPU's bf16 and fp16 matmuls accumulate in FP32 as the GPU's do, but their
kernels differ, so a CPU figure is evidence for the GPU's choice, not the GPU's figure.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch

from ldlm.files import write_atomically
from ldlm.pipeline import LDLMPipeline
from ldlm.serve.runtime.backends import open_pipeline
from ldlm.serve.runtime.registry import EAGER
from ldlm.serve.runtime.torch_backends import TORCH_DTYPES

PRECISIONS = ("bf16", "fp16")


def generate(pipe: LDLMPipeline, args: argparse.Namespace, seed: int, autocast: torch.dtype | None = None) -> torch.Tensor:
    with torch.autocast(pipe.device.type, dtype=autocast, enabled=autocast is not None):
        return pipe.generate(n=args.samples, length=args.length, seed=seed).token_ids.cpu()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    reference = LDLMPipeline.from_checkpoint(args.checkpoint, args.device)
    served = {p: open_pipeline(args.checkpoint, backend=EAGER, precision=p, device=args.device) for p in PRECISIONS}
    rows: list[dict[str, Any]] = []
    for seed in args.seeds:
        fp32 = generate(reference, args, seed)
        for precision in PRECISIONS:
            for how, ids in (
                ("served", generate(served[precision], args, seed)),
                ("autocast", generate(reference, args, seed, TORCH_DTYPES[precision])),
            ):
                rows.append({"precision": precision, "how": how, "seed": seed, "same_tokens": float((ids == fp32).double().mean())})
    summary = {
        f"{precision}-{how}": round(
            sum(r["same_tokens"] for r in rows if r["precision"] == precision and r["how"] == how) / len(args.seeds), 5
        )
        for precision in PRECISIONS
        for how in ("served", "autocast")
    }
    return {"summary": summary, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a trained checkpoint directory")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--samples", type=int, default=32, help="samples per seed (default: 32)")
    parser.add_argument("--length", type=int, default=128, help="tokens per sample (default: 128)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3], help="seeds (default: 0 1 2 3)")
    parser.add_argument("--out", type=Path, required=True, help="the JSON report to write")
    args = parser.parse_args()
    start = time.perf_counter()
    report = measure(args)
    report["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    report["host"] = {"machine": platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    report["seconds"] = round(time.perf_counter() - start, 1)
    write_atomically(args.out, json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["summary"], indent=2))


if __name__ == "__main__":
    main()
