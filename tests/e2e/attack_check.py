"""Send the hardening and fair-scheduling attacks to a real `ldlm serve` on 127.0.0.1 and write what happened as JSON.

Measures, for the server code of any checkout (run it with that checkout's interpreter):
1. memory: RSS warm (each route run once, small), after one huge /v2 request ([520000, 1] input_ids),
   and after 100 mixed requests (64 texts of ~128 tokens reconstructed, 16 encoded, an [8, 64] infer, a generation);
2. event loop: the worst /v2/health/live latency while a maximum-size JSON request is processed;
3. slow clients: a well-behaved client's latency while 1,100 idle connections are open; how long
   200 slow-header clients stay connected; how long shutdown takes with a client stalled mid-body;
4. abandoned work: a small generation's time right after a client gave up on a big one.

    python tests/e2e/attack_check.py --source ONNX_DIR --out after.json
    python tests/e2e/attack_check.py --source ONNX_DIR --python /other/.venv/bin/python --cwd /other/checkout --out before.json

Without --source a tiny checkpoint is made and exported to a scratch folder.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from scripts.harness.loopback import free_port, serve_command, stop_server, tiny_export, wait_ready
from scripts.harness.traffic import latent_width, write_report

TEXT = (
    "Latent diffusion for language models first maps text into a continuous latent space with an autoencoder, "
    "then trains a diffusion model over those latents, and finally decodes samples back into tokens. "
) * 3


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Server:
    def __init__(self, python: str, cwd: str, source: Path, threads: int) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (open for the server's life, closed in stop)
        self.process = subprocess.Popen(
            serve_command(source, self.port, ["--threads", str(threads)], python),
            cwd=cwd,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_ready(self.process, self.url)
        except RuntimeError as error:
            self.log.seek(0)
            raise RuntimeError(f"{error}: {self.log.read().decode(errors='replace')[-2000:]}") from None

    @property
    def rss_mb(self) -> float:
        return rss_mb(self.process.pid)

    def stop(self) -> int | str:
        """SIGTERM, as an operator stops it (killed if it does not exit in time): its exit code."""
        code = stop_server(self.process)
        self.log.close()
        return code


def encoder_json(batch: int, seq: int) -> dict[str, Any]:
    ids = np.random.default_rng(0).integers(0, 50000, (batch, seq)).tolist()
    return {
        "inputs": [
            {"name": "input_ids", "shape": [batch, seq], "datatype": "INT64", "data": ids},
            {"name": "attention_mask", "shape": [batch, seq], "datatype": "INT64", "data": [[1] * seq] * batch},
        ]
    }


def binary_body(batch: int, seq: int) -> tuple[bytes, dict[str, str]]:
    ids = np.ones((batch, seq), dtype=np.int64)
    header = {
        "inputs": [
            {"name": "input_ids", "shape": [batch, seq], "datatype": "INT64", "parameters": {"binary_data_size": ids.nbytes}},
            {"name": "attention_mask", "shape": [batch, seq], "datatype": "INT64", "parameters": {"binary_data_size": ids.nbytes}},
        ],
        "outputs": [{"name": "latents", "parameters": {"binary_data": True}}],
    }
    head = json.dumps(header).encode()
    return head + ids.tobytes() + ids.tobytes(), {
        "Inference-Header-Content-Length": str(len(head)),
        "Content-Type": "application/octet-stream",
    }


def memory(server: Server) -> dict[str, Any]:
    mixed = [
        ("/v1/reconstruct", {"json": {"texts": [TEXT] * 64}}),
        ("/v1/encode", {"json": {"texts": [TEXT[:200]] * 16}}),
        ("/v2/models/encoder/infer", {"json": encoder_json(8, 64)}),
        ("/v1/generate", {"json": {"n": 4, "length": 64, "steps": 5, "sampler": "ddim"}}),
    ]
    small = [
        ("/v1/reconstruct", {"json": {"texts": ["warm up"]}}),
        ("/v1/encode", {"json": {"texts": ["warm up"]}}),
        ("/v2/models/encoder/infer", {"json": encoder_json(1, 8)}),
        ("/v1/generate", {"json": {"n": 1, "length": 8, "steps": 2}}),
    ]
    with httpx.Client(base_url=server.url, timeout=600) as http:
        for path, kwargs in small:  # warm: every route has run once, at a small size
            http.post(path, **kwargs)
        warm = server.rss_mb
        body, headers = binary_body(520000, 1)  # 8.3 MB: the request
        started = time.perf_counter()
        response = http.post("/v2/models/encoder/infer", content=body, headers=headers)
        large = {
            "status": response.status_code,
            "seconds": round(time.perf_counter() - started, 2),
            "answer": response.text[:200] if response.status_code != 200 else "200 (tensor)",
            "rss_after_mb": round(server.rss_mb, 1),
        }
        statuses: dict[int, int] = {}
        peak = 0.0
        for i in range(100):
            path, kwargs = mixed[i % len(mixed)]
            code = http.post(path, **kwargs).status_code
            statuses[code] = statuses.get(code, 0) + 1
            peak = max(peak, server.rss_mb)
        after = server.rss_mb
    return {
        "rss_warm_mb": round(warm, 1),
        "large_request": large,
        "mixed_statuses": statuses,
        "rss_peak_during_mixed_mb": round(peak, 1),
        "rss_after_100_mixed_mb": round(after, 1),
        "rss_after_over_warm": round(after / warm, 3),
    }


def memory_per_sample(server: Server, seq: int = 128) -> dict[str, Any]:
    """Peak RSS over warm while one graph runs a batch of 1 and of 16 at ``seq`` tokens; the
    difference over 15 samples is what each further sample costs."""
    rng = np.random.default_rng(0)
    d = latent_width(server.url)
    feeds = {
        "encoder": lambda b: {"input_ids": rng.integers(0, 50000, (b, seq)), "attention_mask": np.ones((b, seq), np.int64)},
        "denoiser": lambda b: {
            "x_t": rng.standard_normal((b, seq, d), np.float32),
            "t": np.full(b, 0.5, np.float32),
            "x0_prev": np.zeros((b, seq, d), np.float32),
            "attention_mask": np.ones((b, seq), np.int64),
        },
        "decoder": lambda b: {"latents": rng.standard_normal((b, seq, d), np.float32), "attention_mask": np.ones((b, seq), np.int64)},
    }
    names = {np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32"}
    report: dict[str, Any] = {"seq": seq, "d_model": d}
    with httpx.Client(base_url=server.url, timeout=600) as http:
        for graph, feed in feeds.items():
            peaks = {}
            for batch in (1, 16, 1, 16):
                arrays = feed(batch)
                header = {
                    "inputs": [
                        {"name": n, "shape": list(a.shape), "datatype": names[a.dtype], "parameters": {"binary_data_size": a.nbytes}}
                        for n, a in arrays.items()
                    ],
                    "parameters": {"binary_data_output": True},
                }
                head = json.dumps(header).encode()
                body = head + b"".join(a.tobytes() for a in arrays.values())
                base = server.rss_mb
                peak, done = [base], threading.Event()

                def sample(done: threading.Event = done, peak: list[float] = peak) -> None:
                    while not done.is_set():
                        peak[0] = max(peak[0], server.rss_mb)
                        time.sleep(0.002)

                sampler = threading.Thread(target=sample)
                sampler.start()
                code = http.post(
                    f"/v2/models/{graph}/infer", content=body, headers={"Inference-Header-Content-Length": str(len(head))}
                ).status_code
                done.set()
                sampler.join()
                assert code == 200, code
                peaks[batch] = peak[0] - base  # the second run of each size counts (the first loads lazily)
            report[graph] = {
                "peak_over_idle_mb_batch1": round(peaks[1], 1),
                "peak_over_idle_mb_batch16": round(peaks[16], 1),
                "mb_per_sample": round((peaks[16] - peaks[1]) / 15, 2),
            }
    return report


def health_during(server: Server, label: str, path: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    latencies: list[float] = []
    done = threading.Event()
    result: dict[str, Any] = {}

    def big() -> None:
        started = time.perf_counter()
        with httpx.Client(base_url=server.url, timeout=600) as http:
            response = http.post(path, **kwargs)
        result.update(status=response.status_code, seconds=round(time.perf_counter() - started, 2), bytes=len(response.content))
        done.set()

    thread = threading.Thread(target=big)
    with httpx.Client(base_url=server.url, timeout=60) as probe:
        thread.start()
        while not done.is_set():
            started = time.perf_counter()
            probe.get("/v2/health/live")
            latencies.append(1000 * (time.perf_counter() - started))
            time.sleep(0.01)
    thread.join()
    return {
        "request": label,
        **result,
        "health_probes": len(latencies),
        "health_max_ms": round(max(latencies), 1),
        "health_p50_ms": round(statistics.median(latencies), 1),
    }


def idle_connections(server: Server, count: int) -> dict[str, Any]:
    sockets = []
    for _ in range(count):
        s = socket.socket()
        s.settimeout(5)
        try:
            s.connect(("127.0.0.1", server.port))
        except OSError:
            s.close()
            break
        sockets.append(s)
    time.sleep(1.0)
    tries = []
    for _ in range(3):
        started = time.perf_counter()
        try:
            with httpx.Client(base_url=server.url, timeout=10) as http:
                code = http.post("/v1/encode", json={"texts": ["a well-behaved client"]}).status_code
        except httpx.TransportError as error:
            code = type(error).__name__
        tries.append({"status": code, "ms": round(1000 * (time.perf_counter() - started), 1)})
    closed_by_server = 0
    for s in sockets:
        s.setblocking(False)
        try:
            closed_by_server += s.recv(1) == b""
        except BlockingIOError:
            pass
        except OSError:
            closed_by_server += 1
        s.close()
    return {"idle_connections": len(sockets), "well_behaved_client": tries, "idle_closed_by_server": closed_by_server}


def slow_headers(server: Server, count: int, cap_s: float) -> dict[str, Any]:
    """Clients that send a request line and then one header byte every 2 s."""
    sockets = []
    for _ in range(count):
        s = socket.create_connection(("127.0.0.1", server.port))
        s.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\n")
        s.setblocking(False)
        sockets.append(s)
    opened, closed_at = time.monotonic(), {}
    while len(closed_at) < count and time.monotonic() - opened < cap_s:
        for i, s in enumerate(sockets):
            if i in closed_at:
                continue
            try:
                if s.recv(4096) == b"":
                    closed_at[i] = time.monotonic() - opened
                    continue
            except BlockingIOError:
                pass
            except OSError:
                closed_at[i] = time.monotonic() - opened
                continue
            try:
                s.send(b"X")
            except OSError:
                closed_at[i] = time.monotonic() - opened
        time.sleep(2.0)
    for s in sockets:
        s.close()
    durations = list(closed_at.values())
    return {
        "slow_header_clients": count,
        "closed_by_server": len(closed_at),
        "still_open_after_s": None if len(closed_at) == count else cap_s,
        "max_open_s": round(max(durations), 1) if durations else None,
    }


def abandoned_generation(server: Server) -> dict[str, Any]:
    """A client gives up on a big plain generation after 1 s (curl -m 1); how long the next small
    request takes, and whether the server counted the cancelled work."""
    big = {"n": 64, "length": 128, "steps": 1000, "seed": 0, "sampler": "ddim"}
    started = time.perf_counter()
    try:
        status: int | str = httpx.post(f"{server.url}/v1/generate", json=big, timeout=1).status_code
    except httpx.TimeoutException:
        status = "client gave up after 1 s"
    abandoned_s = time.perf_counter() - started
    started = time.perf_counter()
    small = httpx.post(f"{server.url}/v1/generate", json={"n": 1, "length": 8, "steps": 2}, timeout=120)
    small_s = time.perf_counter() - started
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    cancelled = [line for line in metrics.splitlines() if line.startswith(("ldlm_request_cancelled_total", "ldlm_cancelled_samples_total"))]
    return {
        "big": big,
        "big_status": status,
        "big_seconds": round(abandoned_s, 2),
        "small_status": small.status_code,
        "small_seconds_after": round(small_s, 3),
        "cancel_metrics": cancelled,
    }


def shutdown_with_stalled_client(server: Server, cap_s: float) -> dict[str, Any]:
    s = socket.create_connection(("127.0.0.1", server.port))
    s.sendall(b'POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"texts": [')
    time.sleep(1.0)
    started = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    try:
        code = server.process.wait(cap_s)
    except subprocess.TimeoutExpired:
        code = None
    seconds = time.monotonic() - started
    s.close()
    return {"shutdown_s": round(seconds, 1), "exit_code": code, "cap_s": cap_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, help="an `ldlm export` directory (default: export a tiny checkpoint)")
    parser.add_argument("--python", default=sys.executable, help="interpreter that runs the server (default: this one)")
    parser.add_argument("--cwd", default=str(Path(__file__).resolve().parents[2]), help="checkout the server runs from")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--idle", type=int, default=1100, help="idle connections to open (default: 1100)")
    parser.add_argument(
        "--sections",
        default="memory,health_during_large,abandoned,idle,slow_headers,shutdown",
        help="what to measure, in order (also: memory_per_sample)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    scratch = tempfile.TemporaryDirectory(prefix="ldlm-attack-")
    source = args.source or tiny_export(Path(scratch.name))
    report: dict[str, Any] = {"server_python": args.python, "server_cwd": args.cwd}
    server = Server(args.python, args.cwd, source, args.threads)
    sections = {
        "memory": lambda: memory(server),
        "memory_per_sample": lambda: memory_per_sample(server),
        "health_during_large": lambda: [
            health_during(server, "encoder JSON input_ids [260000, 1]", "/v2/models/encoder/infer", {"json": encoder_json(260000, 1)}),
            health_during(
                server, "encoder JSON input_ids [64, 128] (largest accepted)", "/v2/models/encoder/infer", {"json": encoder_json(64, 128)}
            ),
            health_during(server, "/v1/encode 64 texts of ~128 tokens", "/v1/encode", {"json": {"texts": [TEXT] * 64}}),
        ],
        "abandoned": lambda: abandoned_generation(server),
        "idle": lambda: idle_connections(server, args.idle),
        "slow_headers": lambda: slow_headers(server, 200, cap_s=40),
        "shutdown": lambda: shutdown_with_stalled_client(server, cap_s=90),
    }
    try:
        for name in args.sections.split(","):
            measure = sections[name]
            if server.process.poll() is not None:  # e.g. killed for memory by an earlier attack
                report[name] = {"error": f"server had exited with {server.process.returncode}"}
                continue
            try:
                report[name] = measure()
            except Exception as error:  # record it; the other attacks still run
                report[name] = {"error": f"{type(error).__name__}: {error}", "server_exit": server.process.poll()}
    finally:
        report["server_exit"] = server.stop()
        scratch.cleanup()
    write_report(report, str(args.out))  # atomically: no half-written report if interrupted


if __name__ == "__main__":
    main()
