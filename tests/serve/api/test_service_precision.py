"""What a server says it runs: the INT8 variants are named in /v2 metadata and /metrics."""

from __future__ import annotations

from pathlib import Path

import httpx

from ldlm.serve.api.service import LDLMService, ServerSettings
from tests.servers import RunningServer, free_port


def test_an_int8_server_names_its_precision_per_graph(int8_export_dir: Path) -> None:
    settings = ServerSettings(port=free_port(), precision="int8", request_timeout_s=30)
    running = RunningServer(LDLMService(str(int8_export_dir), settings))
    try:
        meta = {g: httpx.get(f"{running.url}/v2/models/{g}", timeout=30).json() for g in ("encoder", "denoiser", "decoder")}
        assert {g: m["precision"] for g, m in meta.items()} == {"encoder": "fp32", "denoiser": "int8", "decoder": "int8"}
        metrics = httpx.get(f"{running.url}/metrics", timeout=30).text
        assert 'ldlm_graph_info{backend="ort",model="denoiser",precision="int8",provider="CPUExecutionProvider"} 1.0' in metrics
        assert 'ldlm_graph_info{backend="ort",model="encoder",precision="fp32",provider="CPUExecutionProvider"} 1.0' in metrics
        body = httpx.post(f"{running.url}/v1/generate", json={"n": 1, "length": 8, "steps": 4, "seed": 0}, timeout=60)
        assert body.status_code == 200 and len(body.json()["texts"]) == 1
    finally:
        running.stop()
        running.service.close()
