"""Guards of the core and the serving runtime that no other test triggers, each with the message a
user sees: devices, the pipeline's and sampler's inputs, the tokenizer, GPT-2 weight directories,
the scheduler, the dynamic batcher, the torch and ONNX Runtime backends, TensorRT's plan files and
binding (on CPU: what raises before any GPU work), and the checks' options. The server's own are in
tests/serve/api/test_server_guards.py."""

from __future__ import annotations

import contextlib
import json
import re
import threading
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from ldlm.model.checkpoint import CheckpointError, init_model
from ldlm.model.config import preset


def raises(error: type[Exception], message: str):
    return pytest.raises(error, match=re.escape(message))


# --- ldlm: devices, pipeline, sampler, tokenizer, GPT-2 weights ----------------------------------------


def test_devices_are_named() -> None:
    from ldlm.device import DeviceError, resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    with raises(DeviceError, "device='meta' is not supported; allowed: cpu, cuda, cuda:N"):
        resolve_device("meta")  # a torch device, but not one we run on
    with raises(DeviceError, "device='gpu0' is unknown; allowed: cpu, cuda, cuda:N"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with raises(DeviceError, "device='cuda:1' is not available: "):
            resolve_device("cuda:1")


def test_pipeline_sampler_and_solver_inputs(pipeline) -> None:
    from ldlm.sampling.samplers import get_sampler
    from ldlm.sampling.schedule import time_grid

    with raises(ValueError, "no sequences given; allowed: at least one"):
        pipeline.check_token_ids([])
    latents = torch.zeros(2, 5, pipeline.config.d_model)
    assert pipeline.decode(latents, torch.ones(2, 5, dtype=torch.bool)).token_ids.shape == (2, 5)
    with raises(ValueError, "attention_mask has shape (2, 4); allowed: (2, 5)"):
        pipeline.decode(latents, torch.ones(2, 4, dtype=torch.bool))
    with raises(ValueError, "latents.shape[1]=129 is out of range; allowed: 1..128"):
        pipeline.decode(torch.zeros(1, 129, pipeline.config.d_model))
    with raises(ValueError, "the logsnr grid needs the schedule; pass schedule="):
        time_grid(4, 0.1, "logsnr")
    x = torch.zeros(1, 2, 3)
    t = torch.tensor([1.0])
    with raises(ValueError, "the sde sampler draws noise every step; pass noise="):
        get_sampler("sde").step(pipeline.schedule, x, x, t, t * 0.5, [])


def test_tokenizer_inputs(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    from ldlm.model.tokenizer import TextTokenizer

    with raises(ValueError, "tokenizer has no '<|endoftext|>' token; a GPT-2 BPE vocabulary is required"):
        TextTokenizer(Tokenizer(models.BPE()))
    with raises(ValueError, f"{tmp_path}: no tokenizer found; expected tokenizer.json or vocab.json + merges.txt"):
        TextTokenizer.from_directory(tmp_path)
    (tmp_path / "vocab.json").write_text("{}")  # vocab.json without merges.txt is not a tokenizer either
    with raises(ValueError, f"{tmp_path}: no tokenizer found"):
        TextTokenizer.from_directory(tmp_path)
    gpt2 = TextTokenizer.gpt2()
    with raises(ValueError, "texts[1] is a bytes; allowed: a non-empty str"):
        gpt2.encode(["fine", b"bytes"])
    assert gpt2.decode([15496, 50256, 995]) == "Hello"  # cut at end-of-text
    assert gpt2.decode([15496, 50257, 995]) == "Hello world"  # the mask id (outside GPT-2's table) is dropped


def hf_gpt2_dir(directory: Path, edit=None) -> Path:
    """A GPT-2 directory of the tiny config as Hugging Face writes it (GPT2LMHeadModel.save_pretrained:
    config.json + model.safetensors, names prefixed with transformer.), its tensors optionally edited."""
    from safetensors.torch import load_file, save_file

    transformers = pytest.importorskip("transformers", reason="transformers writes the GPT-2 directory (pip install -e .[test])")
    config = preset("tiny")
    hf_config = transformers.GPT2Config(
        n_layer=config.gpt2_layers,
        n_embd=config.d_model,
        n_head=config.n_heads,
        vocab_size=config.gpt2_vocab_size,
        n_positions=config.gpt2_positions,
    )
    torch.manual_seed(1)
    transformers.GPT2LMHeadModel(hf_config).save_pretrained(directory)
    weights = directory / "model.safetensors"
    if edit is not None:
        state = load_file(str(weights))
        edit(state)
        weights.unlink()
        if state:
            save_file(state, str(weights))
    return directory


def test_gpt2_weight_directories_are_checked_tensor_by_tensor(tmp_path: Path) -> None:
    tiny = preset("tiny")
    from safetensors.torch import load_file

    ok = hf_gpt2_dir(tmp_path / "ok")
    loaded = init_model(tiny, seed=0, gpt2_dir=ok)
    assert torch.equal(loaded.feature_model.wpe.weight, load_file(str(ok / "model.safetensors"))["transformer.wpe.weight"])
    empty = hf_gpt2_dir(tmp_path / "empty", lambda s: s.clear())
    with raises(CheckpointError, f"GPT-2 directory {empty} has no model.safetensors (pickle weights are never loaded)"):
        init_model(tiny, seed=0, gpt2_dir=empty)
    missing = hf_gpt2_dir(tmp_path / "missing", lambda s: s.pop("transformer.h.1.ln_2.bias"))
    with raises(CheckpointError, f"{missing / 'model.safetensors'} has no tensor h.1.ln_2.bias (nor transformer.h.1.ln_2.bias)"):
        init_model(tiny, seed=0, gpt2_dir=missing)
    short = hf_gpt2_dir(tmp_path / "short", lambda s: s.update({"transformer.wpe.weight": s["transformer.wpe.weight"][:64]}))
    with raises(CheckpointError, f"{short / 'model.safetensors'}: tensor wpe.weight has shape (64, 64), expected (128, 64)"):
        init_model(tiny, seed=0, gpt2_dir=short)


# --- the scheduler and the dynamic batcher -----------------------------------------------------------


def test_scheduler_settings_and_requests(pipeline) -> None:
    from ldlm.serve.runtime.scheduler import GenerateRequest, GenerationScheduler

    with raises(ValueError, "max_batch=0 is out of range; allowed: >= 1"):
        GenerationScheduler(pipeline, max_batch=0, start=False)
    with raises(ValueError, "policy='eager' is unknown; allowed: continuous, static"):
        GenerationScheduler(pipeline, policy="eager", start=False)  # type: ignore[arg-type]
    scheduler = GenerationScheduler(pipeline, max_batch=1)
    d = pipeline.config.d_model
    try:
        spec = GenerateRequest(n=1, length=4, steps=1, sampler="ddim")
        for prefix in (torch.zeros(4, d), torch.zeros(2, d + 1), torch.zeros(3)):
            with raises(ValueError, f"prefix has shape {tuple(prefix.shape)}; allowed: (P, {d}) with P < length=4"):
                scheduler.submit(spec, prefix)
        with raises(ValueError, "preview_every=-1 is out of range; allowed: >= 0 (0: no previews)"):
            scheduler.submit(spec, None, lambda *a: None, -1)
        assert scheduler.submit(spec, torch.zeros(3, d)).result(30).token_ids.shape == (1, 4)  # P = length - 1 is allowed
    finally:
        scheduler.close()
    with raises(RuntimeError, "the scheduler is shut down"):
        scheduler.submit(spec)


class BlockingBackend:
    """A graph backend stand-in whose run waits for ``release``: the batcher's queue can be filled."""

    graph = "g"
    inputs = [{"name": "x", "dtype": "FLOAT", "shape": ["batch", 2]}]
    outputs = [{"name": "y", "dtype": "FLOAT", "shape": ["batch", 2]}]
    input_names = ["x"]

    def __init__(self) -> None:
        self.release, self.started = threading.Event(), threading.Event()

    def check_inputs(self, inputs):
        return {"x": np.asarray(inputs["x"], np.float32)}

    def worker_context(self):
        return contextlib.nullcontext()

    def run(self, inputs):
        self.started.set()
        self.release.wait(30)
        return {"y": inputs["x"] * 2}


def test_batcher_settings_queue_and_shutdown() -> None:
    from ldlm.serve.runtime.batcher import DynamicBatcher
    from ldlm.serve.runtime.queueing import QueueFullError

    backend = BlockingBackend()
    for kwargs, message in (
        ({"max_batch": 0}, "max_batch=0 is out of range; allowed: >= 1"),
        ({"max_delay_ms": -1}, "max_delay_ms=-1 is out of range; allowed: >= 0"),
        ({"max_queue": 0}, "max_queue=0 is out of range; allowed: >= 1"),
    ):
        with raises(ValueError, message):
            DynamicBatcher(backend, **kwargs)  # type: ignore[arg-type]
    batcher = DynamicBatcher(backend, max_batch=1, max_delay_ms=0, max_queue=1)  # type: ignore[arg-type]
    try:
        first = batcher.submit({"x": np.ones((1, 2))})
        assert backend.started.wait(30)  # the worker holds the first request: the queue is empty again
        second = batcher.submit({"x": np.full((1, 2), 3.0)})  # one waiting: the queue's limit
        with raises(QueueFullError, "g queue is full (1 requests waiting, max 1)"):
            batcher.submit({"x": np.ones((1, 2))})
        backend.release.set()
        assert first.result(30)["y"].tolist() == [[2.0, 2.0]] and second.result(30)["y"].tolist() == [[6.0, 6.0]]
    finally:
        backend.release.set()
        batcher.close()
    with raises(RuntimeError, "the g batcher is shut down"):
        batcher.submit({"x": np.ones((1, 2))})


# --- backends -------------------------------------------------------------------------------------------


def test_backend_inputs_and_sources(tiny_model, export_dir: Path) -> None:
    from ldlm.serve.runtime.backends import open_graphs
    from ldlm.serve.runtime.graph_backend import BackendError
    from ldlm.serve.runtime.torch_backends import CompiledBackend, EagerBackend, check_precision, resolve_device

    eager = EagerBackend(tiny_model, "denoiser")
    x = torch.zeros(1, 3, 64)
    good = {"x_t": x, "t": torch.zeros(1), "x0_prev": x, "attention_mask": torch.ones(1, 3, dtype=torch.int64)}
    eager.check_tensors(good)
    for inputs in ({k: v for k, v in good.items() if k != "t"}, {**good, "extra": x}):
        with raises(
            BackendError, f"denoiser: inputs {sorted(inputs)} do not match; allowed: exactly ['x_t', 't', 'x0_prev', 'attention_mask']"
        ):
            eager.check_tensors(inputs)
    with raises(BackendError, "batch_buckets=[2, 0] is invalid; allowed: integers >= 1"):
        CompiledBackend(tiny_model, "denoiser", batch_buckets=[2, 0])
    with raises(BackendError, "batch_buckets=[] is invalid"):
        CompiledBackend(tiny_model, "denoiser", batch_buckets=[])
    with raises(BackendError, "CUDA graphs need a CUDA device; this backend runs on cpu"):
        CompiledBackend(tiny_model, "denoiser", cuda_graphs=True)
    with raises(BackendError, "backend 'eager' cannot run precision='int8'; allowed: fp32"):
        check_precision("int8", "eager")
    with raises(BackendError, "device='meta' is not supported"):
        resolve_device("meta")
    with raises(
        BackendError, f"{export_dir} is not a checkpoint (no model.safetensors); backend 'eager' runs a checkpoint from `ldlm init`"
    ):
        open_graphs("eager", export_dir)


def test_tensorrt_files_and_binding_on_cpu(tmp_path: Path) -> None:
    from ldlm.export.artifact import PlanMismatchError, read_plan_manifest
    from ldlm.export.trt_flavor import bind

    plan = tmp_path / "encoder.plan"
    with raises(PlanMismatchError, f"plan {plan} does not exist; build it with `ldlm build-engine`"):
        read_plan_manifest(plan)
    plan.write_bytes(b"plan")
    with raises(PlanMismatchError, f"plan {plan} has no manifest encoder.plan.json; rebuild it with `ldlm build-engine`"):
        read_plan_manifest(plan)

    context = types.SimpleNamespace(
        set_input_shape=lambda name, shape: True, set_tensor_address=lambda name, address: True, get_tensor_shape=lambda name: (2, -1)
    )
    with raises(RuntimeError, "TensorRT could not infer the shape of output y ((2, -1)); are all input shapes set?"):
        bind(context, {"x": torch.zeros(2, 3)}, ["y"], {"y": torch.float32}, torch.device("cpu"))
    context.get_tensor_shape = lambda name: (2, 3)
    assert bind(context, {"x": torch.zeros(2, 3)}, ["y"], {"y": torch.float32}, torch.device("cpu"))["y"].shape == (2, 3)


# --- the checks' options ------------------------------------------------------------------------------


def test_check_options_are_named(tiny_checkpoint: Path, tiny_model, tmp_path: Path) -> None:
    from ldlm.export.layernorm.compare import tolerance
    from ldlm.export.layernorm.eps_probe_ort import OrtNodeRunner
    from ldlm.export.layernorm.eps_probe_trt import probe_engines, run_normalization_plan
    from ldlm.serve.checks.bench import run_bench
    from ldlm.serve.checks.bench_latency import parse_solver_specs

    assert parse_solver_specs("ddim@50, dpm3m-psc@1,") == [("ddim", 50, None), ("dpm3m-psc", 1, None)]
    assert parse_solver_specs("dpm3m-psc@10:tuned,ddim@5:power") == [("dpm3m-psc", 10, "tuned"), ("ddim", 5, "power")]
    with raises(ValueError, "solver spec 'ddim@5:cosine' names the grid 'cosine'; allowed: tuned, uniform, power, logsnr"):
        parse_solver_specs("ddim@5:cosine")
    for spec in ("ddim@0", "ddim", "ddim@x", "ddim@-2"):
        with raises(ValueError, f"solver spec {spec!r} is invalid; allowed: NAME@STEPS with STEPS an integer >= 1"):
            parse_solver_specs(spec)
    with raises(ValueError, "sampler='euler' is unknown"):
        parse_solver_specs("euler@5")
    with raises(ValueError, "backend='tpu' is unknown; allowed: eager, compiled, inductor, ort, ort-cuda, trt"):
        run_bench(str(tiny_checkpoint), ["tpu"])
    with raises(ValueError, "backend 'trt' needs an engine directory (--engine-dir)"):
        run_bench(str(tiny_checkpoint), ["trt"])
    assert tolerance("fp16") == (2e-2, 2e-2)
    with raises(ValueError, "precision='int4' has no tolerances; allowed: fp32, fp16, bf16, int8"):
        tolerance("int4")
    with pytest.raises(
        ValueError, match=re.escape("ONNX Runtime providers ['NoSuchExecutionProvider'] are not available here; allowed: [")
    ):
        OrtNodeRunner(("CPUExecutionProvider", "NoSuchExecutionProvider"))
    with raises(ValueError, f"{tmp_path} has no encoder.plan, denoiser.plan, decoder.plan; make one with `ldlm build-engine`"):
        probe_engines(tiny_model, tmp_path, None, 0, None, backend="trt")
    if not torch.cuda.is_available():
        with raises(RuntimeError, "running a TensorRT plan needs a CUDA GPU; torch.cuda.is_available() is False"):
            run_normalization_plan(None, None, np.zeros((1, 4), np.float32))  # type: ignore[arg-type]


def test_parity_refuses_an_export_of_another_config(tiny_checkpoint: Path, export_dir: Path, tmp_path: Path) -> None:
    import dataclasses

    from ldlm.model.checkpoint import save_checkpoint
    from ldlm.model.tokenizer import TextTokenizer
    from ldlm.serve.checks.parity import run_parity

    pytest.importorskip("onnxruntime")
    other = save_checkpoint(init_model(dataclasses.replace(preset("tiny"), t_min=0.1), seed=0), TextTokenizer.gpt2(), tmp_path / "other")
    # another config means other weights: the origin check names it first, with both hashes
    with raises(ValueError, f"this export is not from this checkpoint: {export_dir / 'manifest.json'} records weights sha256"):
        run_parity(other, "ort", source=export_dir)


def test_an_engine_output_without_a_batch_axis_is_not_chunked() -> None:
    """A batch beyond every profile runs in chunks only if every output can be put back together
    along a batch axis; the stand-in engine of tests/serve/runtime/test_tensorrt_executor.py with y unbatched."""
    from ldlm.serve.runtime.tensorrt_executor import PlanExecutor
    from tests.serve.runtime.test_tensorrt_executor import AXES, STAND_IN_TRT, StandInEngine, feed

    axes = {**AXES, "y": {"seq": 1}}
    executor = PlanExecutor(StandInEngine([((1, 4), (1, 16))]), STAND_IN_TRT, "stand-in.plan", axes, torch.device("cpu"))
    assert executor.unbatched_outputs == ["y"]
    assert executor.execute(feed(4, 5), 0)["y"].shape == (4, 5, 3)  # one execution: nothing to put back together
    with raises(ValueError, "stand-in.plan: outputs ['y'] have no batch axis, so batch 6 cannot run in chunks [4, 2]"):
        executor.execute(feed(6, 5), 0)
    with raises(ValueError, "missing inputs ['mask']; stand-in.plan takes ['x', 'mask']"):
        executor.execute({"x": torch.zeros(1, 2, 3)}, 0)


def test_a_plan_whose_bytes_differ_from_its_manifest_is_refused_before_tensorrt_reads_it(tmp_path: Path, monkeypatch) -> None:
    """The sha256 check runs after the GPU checks; with those stood in for, it runs here and must
    refuse the plan before TensorRT deserializes a byte of it."""
    pytest.importorskip("tensorrt_rtx", reason="TensorRT-RTX is the .[rtx] extra")
    from ldlm.export.artifact import PlanMismatchError
    from ldlm.export.trt_flavor import GpuInfo
    from ldlm.serve.runtime import trt_runtime

    plan = tmp_path / "encoder.plan"
    plan.write_bytes(b"edited plan bytes")
    (tmp_path / "encoder.plan.json").write_text(json.dumps({"flavor": "tensorrt_rtx", "plan_sha256": "0" * 64}))
    if not torch.cuda.is_available():
        with raises(RuntimeError, f"running {plan} needs a CUDA GPU; torch.cuda.is_available() is False"):
            trt_runtime.TensorRTEngine(plan)
    monkeypatch.setattr(trt_runtime, "gpu_info", lambda device=None: GpuInfo("stand-in GPU", "9.0"))
    monkeypatch.setattr(trt_runtime, "check_plan_manifest", lambda manifest, flavor, gpu: None)
    with raises(PlanMismatchError, f"{plan} does not match the sha256 in its manifest (corrupt or replaced); rebuild it"):
        trt_runtime.TensorRTEngine(plan)
