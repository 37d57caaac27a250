"""Mixed load with faults against `ldlm serve` on 127.0.0.1, for as long as asked: nothing lost, memory flat,
every failure a clean answer.

The server serves a checkpoint on ONNX Runtime from an export cache (the same command at every restart, so a
restart reuses the verified export). Locust, headless, drives the mix of scripts/research/soak_traffic.py:
KServe v2 on each graph (JSON and binary), /v1/generate plain and streamed with previews, with and without a
prompt, /v1/completions plain and streamed and through the openai client at temperature 0 and 0.8, 10% of
clients leaving mid-request, bursts above the generation queue, hostile bodies; and KServe v2 over gRPC on the
server's --grpc-port (the same at every restart; none under --ray, whose proxy serves HTTP only): ModelInfer on
the encoder, small ldlm_generate streams with previews and 10% cancelled mid-way, hostile messages (wrong
datatype, shape and data apart, raw contents for one of two inputs, unknown model and input, NaN, a message
above --max-body-mb, a stream request with N=0 and one without LENGTH), each of which must be refused 4xx.
During the run, at known times:

  sigterm    SIGTERM with requests in flight: the process must exit 0; the same command restarts it
  sigkill    SIGKILL: the restart must find a clean cache (no temporary files) and reuse it (no export)
  ray-replica  with --ray (`ldlm serve --ray --replicas 2`): one replica's process killed; traffic must go on on
             the other, and Ray must bring the replica back
  full-disk  before the run, a 1 MiB tmpfs as the export cache (LDLM_CACHE_DIR): the start must fail with a clear error and
             leave nothing half-written (needs `mount`; recorded as not exercised where it is not permitted)

It samples the server's RSS (its process and children) every 10 s and scrapes /metrics; at the end it checks
that the queues and the running batch are empty, that every request is accounted for, and that the server's
request counters equal the clients' for the last server lifetime. JSON and a PNG out.

  .venv/bin/python scripts/research/soak.py --duration-s 1800 --users 6 --out runs/soak  (docs/measurements/soak-cpu-2026-12-06.json)
  .venv/bin/python scripts/research/soak.py --duration-s 60 --faults sigterm --checkpoint <tiny> (what CI runs)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the loopback helpers, when run as a script from any folder

from ldlm.files import write_atomically  # noqa: E402
from scripts.harness.loopback import free_port, serve_command, wait_ready  # noqa: E402

TRAFFIC = Path(__file__).with_name("soak_traffic.py")
FAULTS = ("sigterm", "sigkill", "full-disk", "ray-replica")
REPLICA = "ServeReplica:ldlm"  # in a Ray Serve replica's process title
CLEAN = {"answered", "left", "server down"}  # with "refused:<4xx>", "refused:503", "refused:504": clean answers
SAMPLE_S = 10.0
# RSS grows while a fresh server's caches and allocator pools fill: growth is judged from this long after a start,
# over at least RSS_JUDGED_S, against RSS_GROWTH_MAX (+10% by the end).
RSS_WARM_UP_S, RSS_JUDGED_S, RSS_GROWTH_MAX = 300.0, 120.0, 0.10
DRIFT_RUN_S, P99_DRIFT_MAX = 600.0, 1.5  # a small generate's p99 drift is judged in runs this long, against this ratio


class Server:
    """`ldlm serve CHECKPOINT` with ``LDLM_CACHE_DIR=CACHE`` as an operator runs it; restarted with the same command."""

    def __init__(self, checkpoint: Path, cache: Path, port: int, log: Path, flags: list[str], grpc_port: int | None = None) -> None:
        self.command = serve_command(checkpoint, port, flags + ([] if grpc_port is None else ["--grpc-port", str(grpc_port)]))
        self.env = {**os.environ, "LDLM_CACHE_DIR": str(cache)}
        self.url, self.log, self.cache = f"http://127.0.0.1:{port}", log, cache
        self.grpc = "" if grpc_port is None else f"127.0.0.1:{grpc_port}"  # "": no gRPC endpoint
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> dict[str, Any]:
        """Started and ready: seconds to ready, and whether this start exported (else it reused the cache)."""
        before = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=self.env)
        seconds = wait_ready(self.process, self.url, 600, self.log)
        said = self.log.read_bytes()[before:].decode(errors="replace")
        return {"ready_s": round(seconds, 2), "exported": "exporting the checkpoint" in said}

    def stop(self, sig: int) -> int:
        assert self.process is not None
        self.process.send_signal(sig)
        return self.process.wait(120)

    def rss_mb(self) -> float:
        """Resident memory of the server and its children (the JSON worker processes)."""
        assert self.process is not None
        pids, total = [self.process.pid], 0.0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == self.process.pid:
                    pids.append(int(stat.parent.name))
            except (OSError, ValueError, IndexError):
                continue
        for pid in pids:
            try:
                total += next(
                    int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("VmRSS:")
                )
            except (OSError, StopIteration):
                continue
        return round(total / 1024, 1)


def scrape(url: str) -> dict[str, float]:
    """/metrics as {'name{labels}': value} (counters' _total samples and gauges)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def counted(metrics: dict[str, float]) -> Counter[str]:
    """Requests the server answered per model label: its success and failure counters, every code."""
    out: Counter[str] = Counter()
    for name, value in metrics.items():
        match = re.match(r'ldlm_request_(success|failure)_total\{.*?model="([^"]*)"', name)
        if match:
            out[match.group(2)] += int(value)
    return out


def full_disk(checkpoint: Path, work: Path) -> dict[str, Any]:
    """A start whose export cache is a 1 MiB tmpfs: it must fail, name the problem, and leave nothing half-written."""
    mount = work / "full-disk"
    mount.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        return {"exercised": False, "why": f"mount -t tmpfs refused: {made.stderr.strip() or made.returncode}"}
    try:
        port = free_port()
        env = {**os.environ, "LDLM_CACHE_DIR": str(mount)}
        run = subprocess.run(serve_command(checkpoint, port), capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
        # the cache's flock files stay by design (empty; the kernel releases a dead holder's lock)
        left = sorted(str(p.relative_to(mount)) for p in mount.rglob("*") if p.is_file() and not p.name.endswith(".lock"))
        said = (run.stderr or "").strip().splitlines()[-1:] or [""]
        return {
            "exercised": True,
            "exit_code": run.returncode,
            "error": said[0],
            "files_left": left,
            "ok": run.returncode != 0 and "space" in said[0].lower() and not left,
        }
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def start_traffic(server: Server, users: int, seconds: float, out: Path, burst: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "SOAK_OUT": str(out), "SOAK_BURST": str(burst), "SOAK_GRPC": server.grpc, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "locust", "-f", str(TRAFFIC), "--headless", "-u", str(users), "-r", str(users)]
    command += ["--run-time", f"{int(seconds)}s", "--stop-timeout", "60", "--host", server.url, "--only-summary", "--loglevel", "WARNING"]
    log = (out / "locust.log").open("ab")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def restart(server: Server, sig: int, marker: Path, at_s: float) -> dict[str, Any]:
    """Stop with ``sig`` while traffic runs, then start the same command: exit code, downtime, what the restart found.
    The marker names the signal: connections refused from here on are the soak's doing, and so, after SIGKILL
    only, are requests cut off mid-answer; after SIGTERM every request the server took must still be answered."""
    marker.write_text(signal.Signals(sig).name)
    stopped = time.perf_counter()
    code = server.stop(sig)
    epoch = time.time()  # from here on only the restarted server can take a request, and it counts each
    temporary = sorted(str(p.relative_to(server.cache)) for p in server.cache.rglob("*") if ".tmp" in p.name or p.name.startswith("tmp"))
    started = server.start()
    marker.unlink()
    return {
        "epoch": epoch,
        "signal": signal.Signals(sig).name,
        "at_s": round(at_s, 1),
        "exit_code": code,
        "temporary_files_after": temporary,
        "recovery_s": round(time.perf_counter() - stopped, 2),
        **started,
    }


def replica_pids() -> list[int]:
    """The processes of this machine's ldlm Ray Serve replicas."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if REPLICA in cmdline.read_bytes().decode(errors="replace"):
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return sorted(pids)


def kill_replica(marker: Path, at_s: float, replicas: int = 2) -> dict[str, Any]:
    """SIGKILL one replica while traffic runs; seconds until Ray has ``replicas`` again without it. The marker
    says so to the clients: answers refused while a replica is gone are counted apart, not as clean ones."""
    before = replica_pids()
    if len(before) < replicas:
        return {"exercised": False, "why": f"{len(before)} replica processes found, {replicas} expected"}
    marker.write_text("REPLICA")
    started = time.perf_counter()
    os.kill(before[0], signal.SIGKILL)
    while time.perf_counter() - started < 300:
        now = replica_pids()
        if before[0] not in now and len(now) >= replicas:
            break
        time.sleep(0.5)
    restored = time.perf_counter() - started
    marker.unlink()
    return {
        "exercised": True,
        "at_s": round(at_s, 1),
        "killed_pid": before[0],
        "restored_s": round(restored, 1),
        "replicas_after": len(replica_pids()),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("traffic-*.json"):
        old.unlink()
    report: dict[str, Any] = {
        "checkpoint": str(args.checkpoint),
        "duration_s": args.duration_s,
        "users": args.users,
        "ray": args.ray,
        "faults": {},
    }
    if "full-disk" in args.faults:
        report["faults"]["full-disk"] = full_disk(Path(args.checkpoint), out)
    flags = ["--max-queue", str(args.max_queue), *(["--ray", "--replicas", "2", "--threads", "1"] if args.ray else [])]
    port = free_port()
    grpc_port = None if args.ray else free_port({port})  # Ray's proxy serves HTTP alone
    server = Server(Path(args.checkpoint), out / "cache", port, out / "server.log", flags, grpc_port)
    report["grpc"] = server.grpc or None
    report["first_start"] = server.start()
    plan = {fault: args.duration_s * (i + 1) / (len(args.faults) + 1) for i, fault in enumerate(f for f in args.faults if f != "full-disk")}
    traffic, began = start_traffic(server, args.users, args.duration_s, out, 16 * args.max_queue + 32), time.perf_counter()
    samples, last_epoch = [], time.time()
    while traffic.poll() is None:
        now = time.perf_counter() - began
        for fault, at in list(plan.items()):
            if now >= at:
                del plan[fault]
                if fault == "ray-replica":
                    report["faults"][fault] = kill_replica(out / "server-down", now)
                    continue
                sig = signal.SIGTERM if fault == "sigterm" else signal.SIGKILL
                report["faults"][fault] = restart(server, sig, out / "server-down", now)
                last_epoch = report["faults"][fault].pop("epoch")
        samples.append({"t_s": round(now, 1), "rss_mb": server.rss_mb(), **gauges(scrape(server.url))})
        time.sleep(min(SAMPLE_S, max(0.5, args.duration_s + 90 - now)))
    time.sleep(2)  # the last answers' counters
    final = scrape(server.url)
    report["end"] = gauges(final)
    report["samples"] = samples
    report["traffic"] = traffic_totals(out, last_epoch, counted(final))
    report["shutdown_exit_code"] = server.stop(signal.SIGTERM)
    report["targets"] = targets(report)
    return report


def gauges(metrics: dict[str, float]) -> dict[str, float]:
    """What is waiting or running now: every queue, the running batch, the generations in flight."""
    keep = {"ldlm_generate_active_samples": "active_samples", "ldlm_generate_in_flight": "in_flight"}
    out = {short: metrics.get(name, float("nan")) for name, short in keep.items()}
    out["queued"] = sum(v for k, v in metrics.items() if k.startswith("ldlm_queue_depth{"))
    return out


def traffic_totals(out: Path, last_epoch: float, server_counts: Counter[str]) -> dict[str, Any]:
    """The Locust processes' counts added up: outcomes per route, per-minute p50/p99, and the clients' requests
    sent to the last server lifetime against that server's own counters."""
    outcomes: Counter[str] = Counter()
    per_route: dict[str, Counter[str]] = defaultdict(Counter)
    minutes: dict[tuple[str, int], list[float]] = defaultdict(list)
    client: Counter[str] = Counter()
    for path in out.glob("traffic-*.json"):
        data = json.loads(path.read_text())
        for route, outcome, n in data["outcomes"]:
            outcomes[outcome] += n
            per_route[route][outcome] += n
        for route, minute, values in data["latencies"]:
            minutes[(route, minute)] += values
        reached = ("server down", "no connection")  # never reached a server
        client.update(
            model for start, model, outcome in data["sent"] if start >= last_epoch and outcome not in reached and model is not None
        )
    latency = {
        f"{route}@{minute}": {"n": len(v), "p50_ms": round(percentile(v, 50), 1), "p99_ms": round(percentile(v, 99), 1)}
        for (route, minute), v in sorted(minutes.items())
    }
    return {
        "outcomes": dict(outcomes),
        "per_route": {r: dict(c) for r, c in per_route.items()},
        "latency": latency,
        "last_lifetime": {"clients": dict(client), "server": dict(server_counts)},
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] if ordered else float("nan")


def targets(report: dict[str, Any]) -> dict[str, Any]:
    """Each target, its measured value and whether it is met (None: not measurable in a run this short)."""
    outcomes = report["traffic"]["outcomes"]
    bad_5xx = sum(
        n for o, n in outcomes.items() if o.startswith("refused:5") and o not in ("refused:503", "refused:504") and "replica" not in o
    )
    rows: dict[str, Any] = {
        "no_answer": {
            "value": sum(n for o, n in outcomes.items() if o.startswith("no answer")),
            "met": not any(o.startswith("no answer") for o in outcomes),
        },
        "no_connection_while_up": {"value": outcomes.get("no connection", 0), "met": outcomes.get("no connection", 0) == 0},
        "unparseable": {"value": outcomes.get("unparseable", 0), "met": outcomes.get("unparseable", 0) == 0},
        "5xx_other_than_503_504": {"value": bad_5xx, "met": bad_5xx == 0},
        "5xx_while_a_replica_was_down": {"value": sum(n for o, n in outcomes.items() if "replica" in o), "met": None},
        "503_without_retry_after": {
            "value": outcomes.get("503 without Retry-After", 0),
            "met": outcomes.get("503 without Retry-After", 0) == 0,
        },
        "idle_at_end": {"value": report["end"], "met": all(v == 0 for v in report["end"].values())},
        "exit_codes": {
            "value": [f.get("exit_code") for f in report["faults"].values() if "signal" in f and f["signal"] == "SIGTERM"]
            + [report["shutdown_exit_code"]]
        },
    }
    rows["exit_codes"]["met"] = all(code == 0 for code in rows["exit_codes"]["value"])
    restarts = [f for f in report["faults"].values() if "recovery_s" in f]
    rows["recovery"] = {
        "value": [f["recovery_s"] for f in restarts],
        "met": all(f["recovery_s"] <= 60 and not f["exported"] and not f["temporary_files_after"] for f in restarts),
    }
    lifetime = report["traffic"]["last_lifetime"]  # on Ray each replica counts its own: not comparable from one scrape
    rows["metrics_match_clients"] = {"value": lifetime, "met": None if report["ray"] else lifetime["clients"] == lifetime["server"]}
    replica = report["faults"].get("ray-replica")
    if replica is not None:
        rows["ray_replica_restored"] = {
            "value": replica,
            "met": replica.get("exercised") and replica["replicas_after"] >= 2 and replica["restored_s"] < 300,
        }
    rows.update(refusals(report["traffic"]))
    rows.update(trends(report))
    return rows


def refusals(traffic: dict[str, Any]) -> dict[str, Any]:
    """gRPC's bad outcomes beside HTTP's (its INTERNAL is already a refused:500 among the 5xx): a code that stands
    for no HTTP status (UNKNOWN: a handler that raised past its error map), and any hostile request, HTTP or gRPC,
    that came back answered or refused with other than a 4xx."""
    unmapped = sum(n for o, n in traffic["outcomes"].items() if o.startswith("refused:grpc-"))
    hostile = {
        f"{route}: {outcome}": n
        for route, counts in traffic["per_route"].items()
        if route.startswith(("hostile", "grpc hostile"))
        for outcome, n in counts.items()
        if outcome == "answered" or (outcome.startswith("refused:") and not outcome.startswith("refused:4"))
    }
    return {
        "grpc_code_without_http_status": {"value": unmapped, "met": unmapped == 0},
        "hostile_refused_4xx": {"value": hostile, "met": not hostile},
    }


def not_judged(why: str) -> dict[str, Any]:
    """A target a run cannot judge, and why: neither met nor missed."""
    return {"value": None, "met": None, "not_judged": why}


def trends(report: dict[str, Any]) -> dict[str, Any]:
    """RSS growth within the last server lifetime after its warm-up (``rss_growth``), and a small generate's
    p99 in the last minute against minute 5's: only for runs of at least 10 minutes."""
    born = max([0.0, *(f["at_s"] for f in report["faults"].values() if "recovery_s" in f)])
    rows = {"rss_growth": rss_growth(report["samples"], born, report["duration_s"])}
    if report["duration_s"] < DRIFT_RUN_S:
        return rows | {"p99_drift": not_judged(f"run shorter than {DRIFT_RUN_S:g} s (it ran {report['duration_s']:g} s)")}
    latency = report["traffic"]["latency"]
    last = int(report["duration_s"] // 60) - 1
    p5, pn = latency.get("generate small@5", {}).get("p99_ms"), latency.get(f"generate small@{last}", {}).get("p99_ms")
    if not (p5 and pn):
        return rows | {"p99_drift": not_judged(f"no small generate answered in minute {5 if not p5 else last}")}
    return rows | {"p99_drift": {"value": round(pn / p5, 2), "met": pn / p5 <= P99_DRIFT_MAX}}


def rss_growth(samples: list[dict[str, Any]], born: float, duration_s: float) -> dict[str, Any]:
    """The server's RSS at the end against its first sample ``RSS_WARM_UP_S`` after its last start (``born``),
    met within ``RSS_GROWTH_MAX``; not judged where the run leaves less than ``RSS_JUDGED_S`` after the warm-up
    (a window that starts after the run ended judges nothing: it is not a miss)."""
    start = born + RSS_WARM_UP_S
    if duration_s - start < RSS_JUDGED_S:
        needed = start + RSS_JUDGED_S
        return not_judged(
            f"run shorter than {needed:g} s: the server last started at {born:g} s, RSS is judged after {RSS_WARM_UP_S:g} s "
            f"of warm-up over at least {RSS_JUDGED_S:g} s, and the run ended at {duration_s:g} s"
        )
    rss = [s["rss_mb"] for s in samples if start <= s["t_s"]]
    if len(rss) < 2:
        return not_judged(f"fewer than 2 RSS samples from {start:g} s to the end ({len(rss)})")
    growth = rss[-1] / rss[0] - 1
    return {"value": round(growth, 3), "window_s": [start, duration_s], "met": growth <= RSS_GROWTH_MAX}


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ldlm.files import save_figure

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    t = [s["t_s"] / 60 for s in report["samples"]]
    top.plot(t, [s["rss_mb"] for s in report["samples"]])
    top.set_ylabel("server RSS (MB)")
    for fault in report["faults"].values():
        if "recovery_s" in fault:
            top.axvline(fault.get("at_s", 0) / 60, color="grey", lw=0.5)
    for route in sorted({k.split("@")[0] for k in report["traffic"]["latency"]}):
        cells = [(int(k.split("@")[1]) + 0.5, v["p99_ms"]) for k, v in report["traffic"]["latency"].items() if k.split("@")[0] == route]
        bottom.plot([m for m, _ in cells], [p for _, p in cells], marker=".", label=route)
    bottom.set_yscale("log")
    bottom.set_ylabel("p99 per minute (ms)")
    bottom.set_xlabel("minutes")
    bottom.legend(fontsize=6, ncol=2)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--checkpoint", default=str(ROOT / "models" / "ldlm-austen-tiny"), help="checkpoint to serve (default: the reference)"
    )
    parser.add_argument("--duration-s", type=float, default=1800.0, help="seconds of traffic (default: 1800)")
    parser.add_argument("--users", type=int, default=8, help="Locust users (default: 8)")
    parser.add_argument("--max-queue", type=int, default=4, help="the server's --max-queue, small so bursts overflow it (default: 4)")
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, from {', '.join(FAULTS)} (default: all)")
    parser.add_argument("--ray", action="store_true", help="serve with --ray --replicas 2 (the ray-replica fault needs it)")
    parser.add_argument("--out", default="runs/soak", help="folder for the report, the plot and the logs (default: runs/soak)")
    args = parser.parse_args(argv)
    args.faults = [f for f in args.faults.split(",") if f]
    unknown = [f for f in args.faults if f not in FAULTS]
    if unknown:
        parser.error(f"--faults {','.join(unknown)} unknown; allowed: {', '.join(FAULTS)}")
    if ("ray-replica" in args.faults) != args.ray:
        parser.error("--faults ray-replica and --ray go together: the fault kills one of --ray's replicas")
    report = run(args)
    out = Path(args.out)
    write_atomically(out / "soak.json", json.dumps(report, indent=1) + "\n")
    plot(report, out / "soak.png")
    missed = [name for name, row in report["targets"].items() if row["met"] is False]
    print(
        f"soak: {sum(report['traffic']['outcomes'].values())} requests, {report['traffic']['outcomes']}; targets missed: {missed or 'none'}"
    )
    for name, row in report["targets"].items():
        if "not_judged" in row:
            print(f"soak: {name} not judged: {row['not_judged']}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
