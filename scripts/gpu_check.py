#!/usr/bin/env python
"""GPU check (run by scripts/gpu_check.sh): eager CUDA fp32/bf16 against the CPU reference for the
tiny and base configs, then ONNX Runtime's CUDA provider and TensorRT engines where present.
Writes OUT/gpu_check.json; every stage reports what it ran or why it was skipped."""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch


def has(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:
        return False


def cuda_ms(fn, runs: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return round(statistics.median(times), 3)


def eager_stage(preset_name: str) -> dict[str, Any]:
    """The three graphs on CUDA in fp32 (TF32 off) and bf16, against float64-free CPU fp32."""
    from ldlm.checkpoint import init_model
    from ldlm.config import preset

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = init_model(preset(preset_name), seed=0)
    cfg = model.config
    gen = torch.Generator().manual_seed(0)
    b, length, d = 8, min(128, cfg.max_seq_len), cfg.d_model
    ids = torch.randint(0, cfg.gpt2_vocab_size, (b, length), generator=gen)
    mask = torch.ones(b, length, dtype=torch.bool)
    x = torch.randn(b, length, d, generator=gen)
    t = torch.rand(b, generator=gen)
    calls = {
        "encoder": lambda m, dev: m.encode_latents(ids.to(dev), mask.to(dev)),
        "denoiser": lambda m, dev: m.denoise(x.to(dev, next(m.parameters()).dtype), t.to(dev), x.to(dev, next(m.parameters()).dtype), mask.to(dev)),
        "decoder": lambda m, dev: m.decode_logits(x.to(dev, next(m.parameters()).dtype), mask.to(dev)),
    }
    result: dict[str, Any] = {}
    with torch.inference_mode():
        reference = {g: f(model, "cpu").float() for g, f in calls.items()}
        for dtype in (torch.float32, torch.bfloat16):
            gpu = init_model(preset(preset_name), seed=0).to("cuda", dtype)
            for g, f in calls.items():
                out = f(gpu, "cuda").float().cpu()
                err = (out - reference[g]).abs()
                result[f"{g}/{str(dtype)[6:]}"] = {
                    "max_abs": float(err.max()), "ref_max_abs": float(reference[g].abs().max()),
                    "cuda_ms_b8": cuda_ms(lambda: f(gpu, "cuda")),
                }
            del gpu
    return result


def onnx_stages(preset_name: str, work: Path) -> dict[str, Any]:
    from ldlm.checkpoint import init_model, save_checkpoint
    from ldlm.config import preset
    from ldlm.export.onnx_export import export_graphs
    from ldlm.tokenizer import TextTokenizer

    out: dict[str, Any] = {}
    ckpt = save_checkpoint(init_model(preset(preset_name), 0), TextTokenizer.gpt2(), work / f"{preset_name}-ckpt")
    start = time.perf_counter()
    onnx_dir = export_graphs(ckpt, work / f"{preset_name}-onnx", with_logits=True).out
    out["export_s"] = round(time.perf_counter() - start, 1)
    if has("onnxruntime"):
        import onnxruntime as ort

        providers = ort.get_available_providers()
        out["ort_providers_available"] = providers
        if "CUDAExecutionProvider" in providers:
            from ldlm.serve.parity import run_parity

            report = run_parity(ckpt, "ort", source=onnx_dir)
            out["ort_parity"] = report.summary()
        else:
            out["ort"] = "skipped: onnxruntime has no CUDAExecutionProvider here (onnxruntime-gpu not installed)"
    for flavor in ("tensorrt", "tensorrt_rtx"):
        if not has(flavor):
            out[flavor] = f"skipped: {flavor} is not installed"
            continue
        from ldlm.export.engine import BuildOptions, build_engines
        from ldlm.serve.parity import run_parity

        for precision in ("fp32", "fp16", "bf16"):
            key = f"{flavor}/{precision}"
            try:
                start = time.perf_counter()
                engines = build_engines(onnx_dir, work / f"{preset_name}-{flavor}-{precision}", BuildOptions(precision=precision), flavor=flavor).out
                built = round(time.perf_counter() - start, 1)
                report = run_parity(ckpt, "trt", precision, source=engines)
                out[key] = {"build_s": built, "parity": report.summary(), "token_agreement": report.token_agreement,
                            "worst": max((c.max_abs for c in report.graphs), default=None)}
            except Exception as error:  # report what happened (e.g. RTX on a datacenter GPU) and go on
                out[key] = f"failed: {type(error).__name__}: {error}"[:2000]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="runs/gpu_check")
    parser.add_argument("--presets", default="tiny,base")
    args = parser.parse_args()
    report: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if not torch.cuda.is_available():
        report["error"] = "no CUDA device visible to torch"
    else:
        report["gpu"] = torch.cuda.get_device_name()
        report["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
        for name in args.presets.split(","):
            for stage, fn in (("eager", lambda: eager_stage(name)), ("onnx", lambda: onnx_stages(name, Path(tempfile.mkdtemp())))):
                try:
                    report[f"{name}/{stage}"] = fn()
                except Exception:
                    report[f"{name}/{stage}"] = "failed: " + traceback.format_exc(limit=3)[-2000:]
                print(json.dumps({f"{name}/{stage}": report[f"{name}/{stage}"]}, indent=1), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
