"""KServe v2 inputs whose values the graphs cannot mean anything with are answered 400 in the service's
error shape, naming the model, the input, the row and what is allowed: a diffusion time outside
[0, 1], a row of attention_mask without one real position. The real server on 127.0.0.1, ONNX Runtime."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest

from ldlm.serve.api.service import LDLMService, ServerSettings
from tests.servers import RunningServer, free_port

D = 64  # the tiny preset's latent width


@pytest.fixture(scope="module")
def server(export_dir: Path):
    running = RunningServer(LDLMService(str(export_dir), ServerSettings(port=free_port())))
    yield running
    running.stop()


def tensor(name: str, datatype: str, array: np.ndarray) -> dict:
    return {"name": name, "shape": list(array.shape), "datatype": datatype, "data": array.reshape(-1).tolist()}


def denoiser_body(t: list[float], mask: list[list[int]]) -> dict:
    batch, seq = len(mask), len(mask[0])
    x = np.linspace(-1, 1, batch * seq * D, dtype=np.float32).reshape(batch, seq, D)
    return {
        "inputs": [
            tensor("x_t", "FP32", x),
            tensor("t", "FP32", np.array(t, np.float32)),
            tensor("x0_prev", "FP32", np.zeros_like(x)),
            tensor("attention_mask", "INT64", np.array(mask, np.int64)),
        ]
    }


def infer(server: RunningServer, model: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=60) as http:
        return http.post(f"/v2/models/{model}/infer", json=body)


def refused(response: httpx.Response, message: str) -> None:
    assert response.status_code == 400, response.text
    assert response.json() == {"error": message}


@pytest.mark.parametrize(
    "t, row, shown",
    [([5.0], 0, "5"), ([0.5, -0.25], 1, "-0.25"), ([1.0, 1.5], 1, "1.5"), ([-1e-3, 0.5], 0, "-0.001")],
)
def test_a_time_outside_0_1_is_refused(server: RunningServer, t: list[float], row: int, shown: str) -> None:
    response = infer(server, "denoiser", denoiser_body(t, [[1, 1, 1]] * len(t)))
    refused(response, f"denoiser: input t holds {shown} at row {row}; allowed: a number in [0, 1] (the diffusion time)")


def test_the_ends_of_the_time_range_are_served(server: RunningServer) -> None:
    response = infer(server, "denoiser", denoiser_body([0.0, 1.0], [[1, 1, 0], [1, 0, 0]]))
    assert response.status_code == 200, response.text
    (x0_hat,) = response.json()["outputs"]
    assert x0_hat["shape"] == [2, 3, D] and np.isfinite(x0_hat["data"]).all()


MASKLESS_ROW = "input attention_mask row {row} is all zeros; allowed: at least one 1 (a real position) in every row"


def test_a_denoiser_row_without_a_real_position_is_refused(server: RunningServer) -> None:
    response = infer(server, "denoiser", denoiser_body([0.5, 0.5, 0.5], [[1, 0, 0], [0, 0, 0], [1, 1, 0]]))
    refused(response, "denoiser: " + MASKLESS_ROW.format(row=1))  # a row, not the all-padding column 2


def test_every_graph_with_a_mask_refuses_such_a_row(server: RunningServer) -> None:
    ids, mask = np.array([[1, 2, 3], [4, 5, 6]], np.int64), np.array([[0, 0, 0], [1, 1, 1]], np.int64)
    body = {"inputs": [tensor("input_ids", "INT64", ids), tensor("attention_mask", "INT64", mask)]}
    refused(infer(server, "encoder", body), "encoder: " + MASKLESS_ROW.format(row=0))
    latents = np.zeros((2, 3, D), np.float32)
    body = {"inputs": [tensor("latents", "FP32", latents), tensor("attention_mask", "INT64", mask[::-1].copy())]}
    refused(infer(server, "decoder", body), "decoder: " + MASKLESS_ROW.format(row=1))
