#!/usr/bin/env python
"""Benchmark the ONNX export at base size: export time, file sizes, peak RSS, and ONNX Runtime
(CPU) against eager PyTorch per graph at batch 1 and 8, L = 128, side by side in one process.

Writes JSON (default runs/bench_export.json). Latencies are medians of --runs runs; eager and ONNX
Runtime alternate run by run so that machine noise hits both alike.

    python scripts/bench_export.py [--checkpoint CKPT] [--preset base] [--runs 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import torch

from ldlm.export.onnx_export import export_graphs
from ldlm.model.checkpoint import init_model, load_checkpoint, save_checkpoint
from ldlm.model.config import preset
from ldlm.model.ldlm import LDLM
from ldlm.model.tokenizer import TextTokenizer


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def graph_inputs(model: LDLM, graph: str, batch: int, length: int) -> dict[str, np.ndarray]:
    gen = torch.Generator().manual_seed(0)
    d = model.config.d_model
    if graph == "encoder":
        ids = torch.randint(0, model.config.gpt2_vocab_size, (batch, length), generator=gen)
        return {"input_ids": ids.numpy(), "attention_mask": np.ones((batch, length), dtype=np.int64)}
    if graph == "denoiser":
        return {
            "x_t": torch.randn(batch, length, d, generator=gen).numpy(),
            "t": np.full((batch,), 0.5, dtype=np.float32),
            "x0_prev": torch.randn(batch, length, d, generator=gen).numpy(),
            "attention_mask": np.ones((batch, length), dtype=np.int64),
        }
    return {"latents": torch.randn(batch, length, d, generator=gen).numpy(), "attention_mask": np.ones((batch, length), dtype=np.int64)}


def eager_call(model: LDLM, graph: str, inputs: dict[str, np.ndarray]) -> Any:
    t = {k: torch.from_numpy(v) for k, v in inputs.items()}
    if graph == "encoder":
        return model.encode_latents(t["input_ids"], t["attention_mask"].bool())
    if graph == "denoiser":
        return model.denoise(t["x_t"], t["t"], t["x0_prev"], t["attention_mask"].bool())
    return model.decode_tokens(t["latents"], t["attention_mask"].bool())


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", help="checkpoint to export (default: a random-init one of --preset)")
    parser.add_argument("--preset", default="base", choices=["tiny", "base"])
    parser.add_argument("--runs", type=int, default=5, help="timed runs per backend and shape (>= 5)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2, help="threads for both torch and ONNX Runtime")
    parser.add_argument("--out", default="runs/bench_export.json")
    args = parser.parse_args()
    if args.runs < 5:
        parser.error(f"--runs {args.runs} is too few; allowed: >= 5")
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as work:
        work_dir = Path(work)
        if args.checkpoint:
            checkpoint = Path(args.checkpoint)
        else:
            checkpoint = save_checkpoint(init_model(preset(args.preset), seed=0), TextTokenizer.gpt2(), work_dir / "ckpt")
        rss_before = peak_rss_mb()
        start = time.perf_counter()
        export = export_graphs(checkpoint, work_dir / "onnx", progress=True)
        export_s = time.perf_counter() - start
        report: dict[str, Any] = {
            "preset": args.preset if not args.checkpoint else None,
            "checkpoint": str(args.checkpoint) if args.checkpoint else f"random-init {args.preset}",
            "torch": torch.__version__,
            "onnxruntime": ort.__version__,
            "threads": args.threads,
            "export": {
                "seconds": round(export_s, 2),
                "peak_rss_mb_before": round(rss_before, 1),
                "peak_rss_mb_after": round(peak_rss_mb(), 1),
                "verified": all(r.passed for r in export.verification),
                "files_mb": {
                    name: {f: round(info["bytes"] / 2**20, 2) for f, info in graph["files"].items()}
                    for name, graph in export.manifest["graphs"].items()
                },
            },
            "latency_ms": {},
        }
        model, _ = load_checkpoint(checkpoint)
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        options.inter_op_num_threads = 1
        for graph in ("encoder", "denoiser", "decoder"):
            session = ort.InferenceSession(str(work_dir / "onnx" / f"{graph}.onnx"), options, providers=["CPUExecutionProvider"])
            for batch in (int(b) for b in args.batches.split(",")):
                inputs = graph_inputs(model, graph, batch, args.length)
                with torch.inference_mode():
                    eager_call(model, graph, inputs)  # warm-up
                    session.run(None, inputs)
                    eager, onnx_rt = [], []
                    for _ in range(args.runs):  # alternate, so noise hits both backends alike
                        eager.append(timed(lambda: eager_call(model, graph, inputs)))  # noqa: B023 (called at once)
                        onnx_rt.append(timed(lambda: session.run(None, inputs)))  # noqa: B023, F821 (called at once, before the del)
                e, o = statistics.median(eager), statistics.median(onnx_rt)
                report["latency_ms"][f"{graph}/b{batch}/L{args.length}"] = {
                    "eager_median": round(e, 2),
                    "ort_cpu_median": round(o, 2),
                    "speedup": round(e / o, 3),
                    "eager_runs": [round(x, 2) for x in eager],
                    "ort_runs": [round(x, 2) for x in onnx_rt],
                }
                print(f"{graph:8s} b{batch} L{args.length}: eager {e:8.1f} ms  ORT {o:8.1f} ms  x{e / o:.2f}", flush=True)
            del session
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
