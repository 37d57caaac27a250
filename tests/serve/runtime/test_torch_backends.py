"""The torch backends on CPU: device and precision handling, and the compiled backend's buckets,
padding and chunking with CUDA graphs switched off (the CUDA-graph capture itself needs a GPU)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ldlm.model.ldlm import LDLM
from ldlm.pipeline import LDLMPipeline, bucket_for
from ldlm.serve.checks.bench_latency import graph_feed
from ldlm.serve.runtime.backends import BackendGraphs, open_graphs, ort_providers
from ldlm.serve.runtime.graph_backend import BackendError
from ldlm.serve.runtime.torch_backends import CompiledBackend, EagerBackend, fill_padded, length_buckets, prepare_model, resolve_device

GRAPHS = ("encoder", "denoiser", "decoder")
NO_CUDA = "no CUDA device here"


def ragged_feed(model: LDLM, graph: str) -> dict[str, np.ndarray]:
    """Batch 3, length 10 (buckets 4 x 16), with two padded rows."""
    feed = graph_feed(model.config, graph, 3, 10, seed=5)
    feed["attention_mask"][1, 6:] = 0
    feed["attention_mask"][2, 3:] = 0
    return feed


def test_buckets_round_up_and_keep_max_seq_len() -> None:
    assert [bucket_for(n, (1, 2, 4, 8)) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 9]
    assert length_buckets(128) == (16, 32, 64, 128)
    assert length_buckets(100) == (16, 32, 64, 100)


def test_fill_padded_puts_real_values_top_left_and_masks_the_rest() -> None:
    buffers = {"x_t": torch.full((4, 5, 2), 7.0), "attention_mask": torch.full((4, 5), 7, dtype=torch.int64)}
    values = {"x_t": torch.arange(12.0).reshape(2, 3, 2), "attention_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])}
    fill_padded(buffers, values, {"x_t", "attention_mask"})
    expected_x = torch.zeros(4, 5, 2)
    expected_x[:2, :3] = torch.arange(12.0).reshape(2, 3, 2)
    expected_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1] * 5, [1] * 5])
    assert torch.equal(buffers["x_t"], expected_x)
    assert torch.equal(buffers["attention_mask"], expected_mask)


@pytest.mark.parametrize("graph", GRAPHS)
def test_compiled_without_cuda_graphs_matches_eager(tiny_model: LDLM, graph: str) -> None:
    eager = EagerBackend(tiny_model, graph, with_logits=True)
    compiled = CompiledBackend(tiny_model, graph, with_logits=True, cuda_graphs=False)
    assert compiled.bucket(3, 10) == (4, 16)
    feed = ragged_feed(tiny_model, graph)
    reference, got = eager.run(feed), compiled.run(feed)
    valid = feed["attention_mask"].astype(bool)
    for name in eager.output_names:
        assert got[name].shape == reference[name].shape
        if name == "token_ids":
            assert (got[name][valid] == reference[name][valid]).all()
        else:
            np.testing.assert_allclose(got[name][valid], reference[name][valid], atol=2e-5, rtol=1e-5)


def test_compiled_bf16_gives_fp32_outputs_close_to_eager_bf16(tiny_model: LDLM) -> None:
    model = prepare_model(copy.deepcopy(tiny_model), torch.device("cpu"), "bf16")
    feed = ragged_feed(tiny_model, "denoiser")
    eager = EagerBackend(model, "denoiser").run(feed)["x0_hat"]
    compiled = CompiledBackend(model, "denoiser", cuda_graphs=False).run(feed)["x0_hat"]
    assert compiled.dtype == eager.dtype == np.float32
    valid = feed["attention_mask"].astype(bool)
    np.testing.assert_allclose(compiled[valid], eager[valid], atol=0.05, rtol=0.05)


def test_compiled_chunks_batches_above_the_largest_bucket(tiny_model: LDLM) -> None:
    eager = EagerBackend(tiny_model, "denoiser")
    compiled = CompiledBackend(tiny_model, "denoiser", batch_buckets=(1, 2), cuda_graphs=False)
    feed = graph_feed(tiny_model.config, "denoiser", 5, 16, seed=2)
    feed["t"] = np.linspace(0.1, 0.9, 5, dtype=np.float32)
    np.testing.assert_allclose(compiled.run(feed)["x0_hat"], eager.run(feed)["x0_hat"], atol=2e-5, rtol=1e-5)


def test_compiled_pipeline_samples_what_eager_samples(tiny_checkpoint: Path) -> None:
    eager, config, tokenizer = open_graphs("eager", tiny_checkpoint)
    compiled, _, _ = open_graphs("compiled", tiny_checkpoint)
    a = LDLMPipeline(BackendGraphs(eager), tokenizer, config=config).sample_latents(2, 11, 4, 3, "ddim")
    b = LDLMPipeline(BackendGraphs(compiled), tokenizer, config=config).sample_latents(2, 11, 4, 3, "ddim")
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


def test_bf16_runs_matmuls_in_bf16_and_keeps_the_residual_stream_norms_and_logits_in_fp32(tiny_model: LDLM) -> None:
    model = copy.deepcopy(prepare_model(copy.deepcopy(tiny_model), torch.device("cpu"), "bf16"))  # a copy keeps it all
    assert model.denoiser.blocks[0].attn.q_proj.weight.dtype == torch.bfloat16
    assert model.denoiser.blocks[0].attn_norm.weight.dtype == torch.float32
    assert model.token_decoder.head.weight.dtype == torch.float32
    seen: dict[str, torch.Tensor] = {}
    model.denoiser.blocks[0].attn.q_proj.register_forward_hook(lambda m, args, out: seen.update(q=out))
    model.denoiser.blocks[0].register_forward_hook(lambda m, args, out: seen.update(block=out))
    EagerBackend(model, "denoiser").run(ragged_feed(tiny_model, "denoiser"))
    assert seen["q"].dtype == torch.bfloat16  # the matmul in bf16 ...
    assert seen["block"].dtype == torch.float32  # ... added to an FP32 residual stream
    norm = model.token_decoder.norm
    norm.register_forward_hook(lambda m, args, out: seen.update(x=args[0]))
    decoder = EagerBackend(model, "decoder", with_logits=True)
    feed = ragged_feed(tiny_model, "decoder")
    out = decoder.run_tensors({n: torch.from_numpy(a) for n, a in feed.items()})
    assert seen["x"].dtype == torch.float32  # the LayerNorm's input and weights FP32 ...
    with torch.inference_mode():
        expected = F.layer_norm(seen["x"], norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        logits = F.linear(expected, model.token_decoder.head.weight, model.token_decoder.head.bias)
    # ... and the head computed in FP32 from its output: fp32's logits wherever fp32's LayerNorm output is.
    assert out["logits"].dtype == torch.float32
    torch.testing.assert_close(out["logits"], logits, atol=1e-6, rtol=1e-6)
    # bf16 against fp32 on the same inputs: close, not equal.
    reference = EagerBackend(tiny_model, "decoder", with_logits=True).run(feed)["logits"]
    valid = feed["attention_mask"].astype(bool)
    cos = F.cosine_similarity(torch.from_numpy(reference[valid]), out["logits"][torch.from_numpy(valid)], dim=-1)
    assert cos.min() > 0.99
    assert not np.array_equal(reference[valid], out["logits"][torch.from_numpy(valid)].numpy())


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: the no-CUDA messages cannot be seen here")
def test_missing_cuda_is_a_clear_error() -> None:
    with pytest.raises(BackendError, match=r"device='cuda' is not available: .*allowed here: cpu"):
        resolve_device("cuda")
    with pytest.raises(BackendError, match=r"device='tpu' is unknown; allowed: cpu, cuda, cuda:N"):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: the no-CUDA messages cannot be seen here")
@pytest.mark.parametrize(
    "command",
    [
        ["serve", "{ckpt}", "--backend", "compiled", "--device", "cuda", "--precision", "bf16"],
        ["bench", "{ckpt}", "--backends", "eager", "--device", "cuda"],
        ["parity", "{ckpt}", "--backend", "eager", "--device", "cuda", "--precision", "bf16"],
        ["generate", "{ckpt}", "--device", "cuda"],
        ["reconstruct", "{ckpt}", "some text", "--device", "cuda"],
        ["tune-schedule", "{ckpt}", "--device", "cuda", "--steps", "4"],
    ],
)
def test_cli_device_cuda_without_cuda_is_a_message_not_a_traceback(tiny_checkpoint: Path, tmp_path: Path, command: list[str]) -> None:
    argv = [a.format(ckpt=tiny_checkpoint) for a in command] + ["--out", str(tmp_path / "out")] * (
        command[0] in ("bench", "parity", "tune-schedule")
    )
    done = subprocess.run([sys.executable, "-m", "ldlm.cli", *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert f"ldlm {command[0]}: error: device='cuda' is not available" in done.stderr


def test_ort_gpu_provider_without_onnxruntime_gpu_names_what_is_missing(export_dir: Path) -> None:
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed: the missing-provider message cannot be seen here")
    with pytest.raises(BackendError, match=r"\['CUDAExecutionProvider'\] are not available here.*onnxruntime-gpu"):
        open_graphs("ort", export_dir, providers=ort_providers("cuda"))
    with pytest.raises(BackendError, match=r"provider='rocm' is unknown; allowed: cpu, cuda, tensorrt"):
        ort_providers("rocm")
    with pytest.raises(BackendError, match=r"backend 'ort' does not take device='cuda'"):
        open_graphs("ort", export_dir, device="cuda")


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"{NO_CUDA}: CUDA-graph capture and replay of the compiled "
    "backend were not exercised (scripts/research/gpu_check.py runs them on the GPU)",
)
@pytest.mark.parametrize("graph", GRAPHS)
def test_cuda_graphs_replay_matches_eager_on_cuda(tiny_model: LDLM, graph: str) -> None:
    model = prepare_model(copy.deepcopy(tiny_model), torch.device("cuda"), "fp32")
    eager, compiled = EagerBackend(model, graph, True), CompiledBackend(model, graph, True)
    assert compiled.cuda_graphs
    feed = ragged_feed(tiny_model, graph)
    first, second = compiled.run(feed), compiled.run(feed)  # capture, then replay
    assert list(compiled.captured) == [(4, 16, True)]  # (batch bucket, length bucket, masked)
    reference = eager.run(feed)
    valid = feed["attention_mask"].astype(bool)
    for name in eager.output_names:
        np.testing.assert_array_equal(first[name], second[name])
        if name != "token_ids":
            np.testing.assert_allclose(first[name][valid], reference[name][valid], atol=1e-4, rtol=1e-4)
