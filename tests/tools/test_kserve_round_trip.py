"""scripts/research/kserve_round_trip.py, so it cannot rot: a short run against `ldlm serve` on a tiny export
(tritonserver left out: the client comparison test runs it), the report's shape and its numbers' own
consistency; and its arithmetic (blocks of back-to-back calls, a block's first call kept apart, overheads over
the right base) on calls whose times are known."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from tests import REPO, import_script

pytest.importorskip("tritonclient.grpc", reason="the script's clients (tritonclient[grpc,http], the test extra)")
pytest.importorskip("onnxruntime", reason="the in-process runner and the server run ONNX Runtime (pip install -e .[cpu])")

SCRIPT = REPO / "scripts" / "research" / "kserve_round_trip.py"


def load_script() -> ModuleType:
    return import_script(SCRIPT)


def test_blocks_keep_each_first_call_apart() -> None:
    script = load_script()
    calls: list[str] = []
    times = script.interleaved({"a x": lambda: calls.append("a"), "b y": lambda: calls.append("b")}, repeats=18, block=4, warmup=1)
    # 18 steady calls of each kind at 3 per block: 6 measured rounds after 1 of warm-up, 4 calls per block
    assert len(calls) == 2 * 7 * 4
    assert [len(times[k]) for k in ("a x", "a x after idle", "b y", "b y after idle")] == [18, 6, 18, 6]
    runs = [calls[i : i + 4] for i in range(0, len(calls), 4)]
    assert all(len(set(run)) == 1 for run in runs)  # a block is one kind, back to back


def test_overheads_are_over_the_runner_and_for_tritonserver_over_the_graph() -> None:
    script = load_script()
    times: dict[str, list[float]] = {}
    for graph, base in (("encoder", 1.0), ("denoiser", 2.0)):
        times.update(
            {
                f"{graph} graph": [base - 0.25] * 3,
                f"{graph} graph after idle": [base] * 3,
                f"{graph} runner": [base] * 3,
                f"{graph} runner after idle": [base + 0.5] * 3,
                f"ldlm serve: {graph} grpc": [base + 0.5, base + 0.75, base + 1.0],  # p50 base + 0.75
                f"ldlm serve: {graph} grpc after idle": [base + 2.0] * 3,
                f"tritonserver: {graph} grpc": [base + 0.25] * 3,
            }
        )
    results = script.summary(times)
    assert results["encoder"]["ldlm serve"]["grpc"] == {"p50_ms": 1.75, "p99_ms": 1.995, "overhead_p50_ms": 0.75}
    assert results["encoder"]["ldlm serve"]["grpc after idle"]["overhead_p50_ms"] == 1.5  # over the runner's own first call
    assert results["denoiser"]["tritonserver"]["grpc"]["overhead_p50_ms"] == 0.5  # over the graph alone: 2.25 - 1.75
    assert script.verdict(results) == {
        "grpc_overhead_p50_ms_max": 0.6,
        "measured": {"encoder": 0.75, "denoiser": 0.75},
        "met": False,
        "grpcio_floor_overhead_p50_ms": None,  # no floor server in these times
        "tritonserver_grpc_overhead_p50_ms": {"encoder": 0.5, "denoiser": 0.5},
    }


def test_a_short_run_against_ldlm_serve(tmp_path: Path) -> None:
    from ldlm.model.checkpoint import init_model, save_checkpoint
    from ldlm.model.config import preset
    from ldlm.model.tokenizer import TextTokenizer

    checkpoint = save_checkpoint(init_model(preset("tiny"), seed=0), TextTokenizer.gpt2(), tmp_path / "ckpt")
    out = tmp_path / "report.json"
    assert load_script().main(["--checkpoint", str(checkpoint), "--repeats", "18", "--no-triton", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    for graph in ("encoder", "denoiser"):
        entry = report["results"][graph]
        assert set(entry) == {"in process", "ldlm serve", "grpcio floor"}
        served, runner = entry["ldlm serve"], entry["in process"]["runner"]["p50_ms"]
        for kind in ("grpc", "http", "grpc_bare"):
            assert served[kind]["p50_ms"] <= served[kind]["p99_ms"]
            assert served[kind]["overhead_p50_ms"] == pytest.approx(served[kind]["p50_ms"] - runner, abs=1e-3)
        assert report["target"]["measured"][graph] == served["grpc"]["overhead_p50_ms"]
        floor = entry["grpcio floor"]["grpc_bare"]  # over the graph alone: the floor server runs it without a batcher
        assert floor["overhead_p50_ms"] == pytest.approx(floor["p50_ms"] - entry["in process"]["graph"]["p50_ms"], abs=1e-3)
        assert report["target"]["grpcio_floor_overhead_p50_ms"][graph] == floor["overhead_p50_ms"]
    assert report["max_abs_difference_between_servers"] == {"encoder": 0.0, "denoiser": 0.0}  # one server: nothing to compare


def test_the_floor_server_answers_what_the_graph_computes(tmp_path: Path) -> None:
    """The floor is a real server running the real graph: its answers are the in-process graph's, bit for bit."""
    import grpc
    import numpy as np
    from tritonclient.grpc import service_pb2_grpc

    from ldlm.export.onnx_export import export_graphs
    from ldlm.model.checkpoint import init_model, save_checkpoint
    from ldlm.model.config import LDLMConfig, preset
    from ldlm.model.tokenizer import TextTokenizer
    from ldlm.serve.checks.bench_latency import graph_feed
    from ldlm.serve.runtime.backends import open_graphs

    script = load_script()
    checkpoint = save_checkpoint(init_model(preset("tiny"), seed=0), TextTokenizer.gpt2(), tmp_path / "ckpt")
    export = export_graphs(checkpoint, tmp_path / "onnx", progress=False).out
    config = LDLMConfig.load(export / "config.json")
    graphs, _, _ = open_graphs("ort", str(export))
    with script.floor_server(export) as address, grpc.insecure_channel(address) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        for graph in ("encoder", "denoiser"):
            feed = graph_feed(config, graph, 1, 8)
            answer = stub.ModelInfer(script.bare_request(graph, feed))
            expected = graphs[graph].run(feed)
            assert [o.name for o in answer.outputs] == list(expected)
            for output, raw in zip(answer.outputs, answer.raw_output_contents, strict=True):
                got = np.frombuffer(raw, expected[output.name].dtype).reshape(tuple(output.shape))
                np.testing.assert_array_equal(got, expected[output.name])
