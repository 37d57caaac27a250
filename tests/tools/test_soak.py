"""The soak (scripts/research/soak.py) as CI runs it: a minute of the mixed traffic, HTTP and gRPC, against
`ldlm serve` on the reference checkpoint, with one SIGTERM and restart mid-run (and the full-disk start where
`mount` is allowed). Every request must be accounted for, the server's counters must equal the clients', every
hostile gRPC message must be refused with its 4xx, the SIGTERM must exit 0 and the restart reuse the cached
export. Locust runs it; the thresholds are the script's own targets."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO

# locust patches the whole process with gevent when imported: look for it, never import it here
if importlib.util.find_spec("locust") is None:
    pytest.skip("the soak's load generator, locust, is not installed (pip install -e .[test])", allow_module_level=True)
pytest.importorskip("onnxruntime", reason="the server runs ONNX Runtime (pip install -e .[cpu])")

ALLOWED = {"answered", "left", "server down", "refused:400", "refused:404", "refused:413", "refused:422", "refused:503", "refused:504"}
# Each hostile gRPC case (soak_traffic's GRPC_HOSTILE_INFER and GRPC_HOSTILE_STREAM, a route each) and its refusal
GRPC_HOSTILE = {
    "wrong datatype": "refused:400",
    "shape and data disagree": "refused:400",
    "raw contents for one of two inputs": "refused:400",
    "unknown model": "refused:404",
    "unknown input": "refused:400",
    "NaN in FP32 contents": "refused:400",
    "message above the size cap": "refused:413",  # grpc's own cap (--max-body-mb): RESOURCE_EXHAUSTED
    "generate N=0": "refused:400",
    "generate without LENGTH": "refused:400",
}


def test_a_minute_with_a_restart_loses_nothing(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "scripts/research/soak.py",
            "--duration-s",
            "60",
            "--users",
            "4",
            "--faults",
            "sigterm,full-disk",
            "--out",
            str(tmp_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    report = json.loads((tmp_path / "soak.json").read_text())
    assert done.returncode == 0, f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}\n{json.dumps(report['targets'], indent=1)[:3000]}"
    outcomes = report["traffic"]["outcomes"]
    assert set(outcomes) <= ALLOWED, outcomes
    assert outcomes.get("answered", 0) > 50 and outcomes.get("refused:503", 0) > 0  # traffic ran, and a burst overflowed
    restart = report["faults"]["sigterm"]
    assert restart["exit_code"] == 0 and not restart["exported"] and restart["recovery_s"] <= 60
    routes = report["traffic"]["per_route"]
    assert routes["grpc infer"].get("answered", 0) > 0 and routes["grpc generate"].get("answered", 0) > 0, routes
    for case, refused in GRPC_HOSTILE.items():  # each sent, and refused as it must be (else only while the server was down)
        got = routes[f"grpc hostile {case}"]
        assert got.get(refused, 0) > 0 and set(got) <= {refused, "server down"}, (case, got)
    lifetime = report["traffic"]["last_lifetime"]
    assert lifetime["clients"] == lifetime["server"] and sum(lifetime["server"].values()) > 0
    assert report["end"] == {"active_samples": 0, "in_flight": 0, "queued": 0}
    disk = report["faults"]["full-disk"]
    assert disk["ok"] if disk["exercised"] else "mount" in disk["why"]
    assert (tmp_path / "soak.png").stat().st_size > 0
