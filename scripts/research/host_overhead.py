#!/usr/bin/env python
"""The host cost of one generation step, with the network's compute removed: what Python and torch's dispatch
cost per step of the serving scheduler (``GenerationScheduler``, unfused and with ``FusedSteps``) and of the
lockstep loop (``LDLMPipeline.run_plan``), per sampler (ddim and the default, dpm3m-psc) and batch.

How the network is removed: a tiny random-init model (the "tiny" preset at d_model 8) runs its denoiser on a
``CompiledBackend`` whose ``_module_outputs`` is replaced, on the instance, by a stub that returns the x0_prev
input as x0_hat and runs no op. Every host-side line around it is kept: the unfused scheduler calls the server's
denoise path (``BackendGraphs.denoise``: the casts, the bucket padding into static buffers, the copy out), the
fused one a real ``FusedSteps`` over that backend (uncaptured on the CPU: its static buffers, no CUDA graph), the
lockstep loop the pipeline's own ``run_plan`` over the same ``BackendGraphs``. Each call of the stub is one
denoiser call: the steps are counted and timed there.

Per (path, sampler, batch): exactly ``batch`` samples of length 16 step together (the scheduler: ``batch``
requests of --per-request samples and 100000 steps each, all queued before its worker starts, with max_batch =
batch; lockstep: one plan of ``batch`` samples), and after 8 warm-up steps:

- op counts, from torch.profiler (CPU, every thread) over 6 steps, from one stub call to the one 6 steps later
  (a marker recorded in the stub), on the thread that steps: ``torch_ops_per_step`` counts the dispatcher's
  ``aten::`` ops at top level (not nested in another aten op, so a composite op counts once, not once per op it
  calls); ``kernel_ops_per_step`` those of them that would launch a GPU kernel: the op or an op nested in it is
  not in ``NO_KERNEL_OPS`` (views, metadata, allocations, and wrappers such as aten::to, clone, reshape or
  contiguous, which launch one only through a nested copy_); ``syncs_per_step`` those that wait for the device
  (``SYNC_OPS``: aten::item and the like). For the fused path, ``in_graph_*_per_step``: those of them inside
  ``FusedSteps.run``, the part of a fused step a CUDA graph captures: on a GPU one replay launches them and the
  host dispatches only the rest. The counts are counts: they do not depend on the machine's load. They are those
  of a CPU run: a GPU run's host-to-device copies of host-built tensors do not show here.
- ``host_ms_per_step_p50``: a separate window without the profiler (--window-s, 10 to 400 steps): the wall time
  between the first and the last stub call over the steps between, median over --repeats runs. One intra-op
  thread (--threads), so the figure is the host's, not a thread pool's.

Each repeat runs in a fresh worker process (this script with a hidden --worker). With --against REV the same
rows are measured for git revision REV's code too (a git worktree, fixed_costs.py's ``revision_tree``, its three
source folders loaded as ldlm, ldlm.export and ldlm.serve), the two codes' workers alternating repeat by repeat:
both side by side in one JSON, each row with its "code" ("now": this checkout), and a comparison per row.

    .venv/bin/python scripts/research/host_overhead.py --out runs/host_overhead
    .venv/bin/python scripts/research/host_overhead.py --out runs/host_overhead --against HEAD~1
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib.metadata
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor
    from torch.autograd.profiler_util import FunctionEvent

    from ldlm.pipeline import LDLMPipeline
    from ldlm.sampling import DenoiseFn
    from ldlm.serve.runtime.torch_backends import CompiledBackend

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve()
OUT_FILE = "host_overhead.json"
PATHS = ("scheduler unfused", "scheduler fused", "lockstep")
SAMPLERS = ("ddim", "dpm3m-psc")
LENGTH = 16
REQUEST_STEPS = 100_000  # a scheduler without limits takes any count: no request finishes while it is measured
WARMUP_STEPS = 8  # past the samplers' history (dpm3m keeps 3 steps): every step after is alike
PROFILE_STEPS = 6
MIN_TIMED_STEPS, MAX_TIMED_STEPS = 10, 400
TIMEOUT_S = 120.0  # for steps that should come within seconds
MARKER = "host_overhead.network"  # recorded by the stub while profiling: where each denoiser call is
IN_GRAPH = "host_overhead.in_graph"  # the range of a fused step that a CUDA graph captures (FusedSteps.run)

# Top-level aten ops that launch no kernel by themselves: views and metadata, allocations, host syncs (counted
# apart), and wrappers that launch one only through a nested op (aten::to, _to_copy, clone, contiguous and reshape
# copy through copy_, zeros through zero_/fill_). A top-level op is a kernel op when it, or an op nested in it, is
# not listed here.
NO_KERNEL_OPS = frozenset(
    {
        *("aten::view", "aten::_unsafe_view", "aten::view_as", "aten::reshape", "aten::_reshape_alias"),
        *("aten::flatten", "aten::unflatten", "aten::slice", "aten::select", "aten::narrow", "aten::expand"),
        *("aten::expand_as", "aten::as_strided", "aten::unsqueeze", "aten::squeeze", "aten::permute", "aten::movedim"),
        *("aten::transpose", "aten::t", "aten::detach", "aten::alias", "aten::unbind", "aten::split"),
        *("aten::split_with_sizes", "aten::chunk", "aten::lift_fresh", "aten::lift", "aten::resize_", "aten::set_"),
        *("aten::empty", "aten::empty_like", "aten::empty_strided", "aten::to", "aten::_to_copy", "aten::clone"),
        *("aten::contiguous", "aten::zeros", "aten::zeros_like", "aten::ones", "aten::ones_like", "aten::full"),
        *("aten::full_like", "aten::scalar_tensor", "aten::result_type", "aten::item", "aten::_local_scalar_dense"),
        *("aten::is_nonzero", "aten::_has_compatible_shallow_copy_type", "aten::is_same_size"),
    }
)
# Ops that wait for the device: a top-level op is a sync when it or an op nested in it is one of these.
SYNC_OPS = frozenset({"aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::nonzero", "aten::equal"})

# fixed_costs.py's REVISION_BOOT, running this script instead of the CLI: the package from the worktree given
# first, its three source folders under the names the installed package maps them to (pyproject's package-dir),
# found before the editable install's finder.
WORKER_BOOT = """
import runpy
import sys
from importlib.util import spec_from_file_location
root = sys.argv.pop(1)
homes = {"ldlm": root + "/ldlm", "ldlm.export": root + "/export", "ldlm.serve": root + "/serve"}
class Finder:
    @staticmethod
    def find_spec(name, path=None, target=None):
        home = homes.get(name)
        return spec_from_file_location(name, home + "/__init__.py", submodule_search_locations=[home]) if home else None
sys.meta_path.insert(0, Finder)
sys.argv.pop(0)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# --- the worker: one repeat of every row, in this process --------------------------------------------------


class NetworkStub:
    """``CompiledBackend._module_outputs`` without the network: every output is the x0_prev input, and no op
    runs. Each call (one denoiser call) is stamped, marked in a running profile while ``marking``, and wakes
    ``wait_for``'s caller once the count it waits for is reached."""

    def __init__(self, output_names: Sequence[str]) -> None:
        self.outputs = len(output_names)
        self.stamps: list[float] = []
        self.marking = False
        self.until = 0
        self.reached = threading.Event()

    def reset(self) -> NetworkStub:
        """No calls yet: the stamps start again."""
        self.stamps, self.until = [], 0
        return self

    def __call__(self, tensors: Mapping[str, Tensor]) -> tuple[Tensor, ...]:
        import torch

        self.stamps.append(time.perf_counter())
        if self.marking:
            with torch.profiler.record_function(MARKER):
                pass
        if len(self.stamps) >= self.until:
            self.reached.set()
        return (tensors["x0_prev"],) * self.outputs

    def wait_for(self, calls: int, timeout_s: float) -> bool:
        """Whether ``calls`` calls were made within ``timeout_s``."""
        deadline = time.perf_counter() + timeout_s
        self.until = calls
        while len(self.stamps) < calls:
            self.reached.clear()
            if len(self.stamps) >= calls:
                break
            left = deadline - time.perf_counter()
            if left <= 0 or not self.reached.wait(left):
                return len(self.stamps) >= calls
        return True


@dataclasses.dataclass
class Stack:
    """The tiny model's pipeline and its denoiser's backend, the network replaced by ``stub``."""

    pipeline: LDLMPipeline
    backend: CompiledBackend
    denoise: DenoiseFn
    stub: NetworkStub


def build_stack() -> Stack:
    import torch

    from ldlm.model.config import preset
    from ldlm.model.ldlm import LDLM
    from ldlm.model.tokenizer import TextTokenizer
    from ldlm.pipeline import LDLMPipeline
    from ldlm.serve.runtime.backends import BackendGraphs
    from ldlm.serve.runtime.torch_backends import CompiledBackend

    config = dataclasses.replace(preset("tiny"), d_model=8, n_heads=2, swiglu_hidden=16)
    torch.manual_seed(0)
    backend = CompiledBackend(LDLM(config).eval(), "denoiser")
    graphs = BackendGraphs({"denoiser": backend})
    pipeline = LDLMPipeline(graphs, TextTokenizer.gpt2(), config=config)
    stub = NetworkStub(backend.output_names)
    backend._module_outputs = stub  # type: ignore[method-assign]  # the network removed
    return Stack(pipeline, backend, graphs.denoise, stub)


def profiled(stub: NetworkStub, run: Callable[[], Any]) -> list[FunctionEvent]:
    """The events of every thread while ``run`` runs, the stub marking each denoiser call."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    every_thread = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as profiler:
        stub.marking = True
        try:
            run()
        finally:
            stub.marking = False
    return list(profiler.events())


def subtree(event: FunctionEvent) -> Iterator[str]:
    yield event.name
    for child in event.cpu_children:
        yield from subtree(child)


def nested_in(event: FunctionEvent, within: Callable[[str], bool]) -> bool:
    """Whether an event that encloses ``event`` has a name ``within`` takes."""
    parent = event.cpu_parent
    while parent is not None:
        if within(parent.name):
            return True
        parent = parent.cpu_parent
    return False


def is_aten(name: str) -> bool:
    return name.startswith("aten::")


def op_counts(ops: Sequence[FunctionEvent], steps: int, prefix: str = "") -> dict[str, float]:
    """Top-level ``ops`` per step, and those of them that launch a kernel or wait for the device."""
    kernels = sum(any(is_aten(n) and n not in NO_KERNEL_OPS for n in subtree(e)) for e in ops)
    syncs = sum(any(n in SYNC_OPS for n in subtree(e)) for e in ops)
    counts = {"torch_ops_per_step": len(ops), "kernel_ops_per_step": kernels, "syncs_per_step": syncs}
    return {prefix + name: round(count / steps, 2) for name, count in counts.items()}


def step_counts(events: Sequence[FunctionEvent], skip: int) -> dict[str, Any]:
    """Top-level aten ops per step on the stepping thread, between the first marker after ``skip`` and the last."""
    markers = sorted((e for e in events if e.name == MARKER), key=lambda e: e.time_range.start)[skip:]
    if len(markers) < 2 or len({m.thread for m in markers}) != 1:
        raise RuntimeError(f"{len(markers)} denoiser calls were marked on {len({m.thread for m in markers})} threads; need >= 2 on one")
    thread, start, end = markers[0].thread, markers[0].time_range.start, markers[-1].time_range.start
    top = [e for e in events if e.thread == thread and is_aten(e.name) and start <= e.time_range.start < end and not nested_in(e, is_aten)]
    steps = len(markers) - 1
    counts: dict[str, Any] = op_counts(top, steps)
    if any(e.name == IN_GRAPH for e in events):  # a fused step: what of it a CUDA graph replays on a GPU
        counts |= op_counts([e for e in top if nested_in(e, IN_GRAPH.__eq__)], steps, "in_graph_")
    by_name = collections.Counter(e.name for e in top)
    top_ops = {name: round(count / steps, 2) for name, count in by_name.most_common(12)}
    return counts | {"steps_profiled": steps, "top_ops_per_step": top_ops}


@contextlib.contextmanager
def in_graph_marked(steps: Any) -> Iterator[None]:
    """``steps.run`` (``FusedSteps.run``: the part of a fused step a CUDA graph captures) recorded as IN_GRAPH
    meanwhile, where the fused steps have one."""
    import torch

    run = getattr(steps, "run", None)
    if run is None:
        yield
        return

    def marked(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(IN_GRAPH):
            return run(*args, **kwargs)

    steps.run = marked
    try:
        yield
    finally:
        del steps.run


def per_step_ms(stamps: Sequence[float]) -> dict[str, Any]:
    steps = len(stamps) - 1
    return {"host_ms_per_step": round(1000 * (stamps[-1] - stamps[0]) / steps, 4), "steps_timed": steps}


def timed_window(stub: NetworkStub, window_s: float) -> dict[str, Any]:
    """ms per step over the next ``window_s`` seconds of steps (MIN_TIMED_STEPS..MAX_TIMED_STEPS of them)."""
    first = len(stub.stamps)
    stub.wait_for(first + MAX_TIMED_STEPS + 1, window_s)
    if not stub.wait_for(first + MIN_TIMED_STEPS + 1, TIMEOUT_S):
        raise RuntimeError(f"fewer than {MIN_TIMED_STEPS} steps in {TIMEOUT_S} s")
    return per_step_ms(stub.stamps[first:])


class Problems(logging.Handler):
    """The warnings and errors logged: e.g. a fused step that failed, after which the steps run unfused."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.name}: {record.getMessage()}")


@contextlib.contextmanager
def logged_problems() -> Iterator[list[str]]:
    handler = Problems()
    logging.getLogger().addHandler(handler)
    try:
        yield handler.lines
    finally:
        logging.getLogger().removeHandler(handler)


def scheduler_row(stack: Stack, sampler: str, batch: int, fused: bool, options: argparse.Namespace) -> dict[str, Any]:
    """``batch`` samples stepping in a scheduler as the server wires it (its denoise path, ``FusedSteps``)."""
    from ldlm.sampling import GenerateRequest
    from ldlm.serve.runtime.scheduler import GenerationScheduler
    from ldlm.serve.runtime.torch_backends import FusedSteps

    stub = stack.stub.reset()
    steps = FusedSteps(stack.backend) if fused else None
    scheduler = GenerationScheduler(stack.pipeline, max_batch=batch, denoise=stack.denoise, fused=steps, start=False)
    sizes = [min(options.per_request, batch - i) for i in range(0, batch, options.per_request)]
    futures = [scheduler.submit(GenerateRequest(n, LENGTH, REQUEST_STEPS, seed=i, sampler=sampler)) for i, n in enumerate(sizes)]
    row: dict[str, Any] = {}
    with logged_problems() as problems:
        scheduler.start()  # every request queued first: all of them join the first step
        try:
            if not stub.wait_for(WARMUP_STEPS, TIMEOUT_S):
                raise RuntimeError(f"the network stub saw {len(stub.stamps)} calls in {TIMEOUT_S} s")
            if options.profile:
                with in_graph_marked(steps):
                    row |= step_counts(profiled(stub, lambda: stub.wait_for(len(stub.stamps) + PROFILE_STEPS + 1, TIMEOUT_S)), 0)
            calls, stepped = scheduler.denoiser_calls, getattr(scheduler, "samples_stepped", None)
            row |= timed_window(stub, options.window_s)
            if stepped is not None:
                row["mean_batch"] = round((scheduler.samples_stepped - stepped) / (scheduler.denoiser_calls - calls), 2)
            check_requests(futures, scheduler.denoiser_calls, len(stub.stamps))
        finally:
            for future in futures:
                future.cancel()
            scheduler.close()
    return row | ({"log": problems} if problems else {})


def check_requests(futures: Sequence[Any], denoiser_calls: int, stub_calls: int) -> None:
    """Every request still running, and every denoiser call the stub's (the network really is the stub)."""
    failed = [f.exception() for f in futures if f.done() and f.exception() is not None]
    if failed:
        raise RuntimeError(f"a request failed while measured: {failed[0]!r}")
    if any(f.done() for f in futures):
        raise RuntimeError(f"a request finished while measured: {REQUEST_STEPS} steps were too few")
    if abs(denoiser_calls - stub_calls) > 1:
        raise RuntimeError(f"{denoiser_calls} denoiser calls, {stub_calls} of them through the stub: the network is not removed")


def lockstep_row(stack: Stack, sampler: str, batch: int, options: argparse.Namespace) -> dict[str, Any]:
    """One plan of ``batch`` samples through the pipeline's own lockstep loop (``run_plan``)."""
    from ldlm.sampling import GenerateRequest, resolve

    pipeline = stack.pipeline

    def run(steps: int) -> list[float]:
        stub = stack.stub.reset()
        plan = resolve(GenerateRequest(batch, LENGTH, steps, seed=0, sampler=sampler), pipeline.config, schedules=pipeline.schedules)
        pipeline.run_plan(plan)
        if len(stub.stamps) != steps:
            raise RuntimeError(f"{steps} steps made {len(stub.stamps)} calls through the stub: the network is not removed")
        return stub.stamps

    calibration = per_step_ms(run(WARMUP_STEPS + MIN_TIMED_STEPS + 1)[WARMUP_STEPS:])["host_ms_per_step"]
    timed = min(MAX_TIMED_STEPS, max(MIN_TIMED_STEPS, round(1000 * options.window_s / calibration)))
    row: dict[str, Any] = {}
    if options.profile:
        row |= step_counts(profiled(stack.stub, lambda: run(WARMUP_STEPS + PROFILE_STEPS + 1)), WARMUP_STEPS)
    return row | per_step_ms(run(WARMUP_STEPS + timed + 1)[WARMUP_STEPS:]) | {"mean_batch": batch}


def measure_row(stack: Stack, path: str, sampler: str, batch: int, options: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"path": path, "sampler": sampler, "batch": batch}
    try:
        if path == "lockstep":
            return row | lockstep_row(stack, sampler, batch, options)
        return row | scheduler_row(stack, sampler, batch, path == "scheduler fused", options)
    except Exception as error:  # one row's failure (e.g. an interface another revision lacks) leaves the others
        return row | {"error": f"{type(error).__name__}: {error}"}


def worker(options: argparse.Namespace) -> int:
    """One repeat of every row in this process, written as JSON to ``options.worker``."""
    import torch

    torch.set_num_threads(options.threads)
    stack = build_stack()
    rows = []
    for batch in options.batches:
        for sampler in options.samplers:
            for path in options.paths:
                row = measure_row(stack, path, sampler, batch, options)
                rows.append(row)
                said = row.get("error") or f"{row['host_ms_per_step']:.3f} ms/step, {row.get('torch_ops_per_step', '-')} ops/step"
                print(f"  {options.code}: {path}, {sampler}, batch {batch}: {said}", file=sys.stderr, flush=True)
    Path(options.worker).write_text(json.dumps(rows))
    return 0


# --- the driver: workers of each code, alternating, and their medians --------------------------------------


def revision_tree(revision: str, work: Path) -> contextlib.AbstractContextManager[Path]:
    """fixed_costs.py's git worktree of ``revision`` (removed afterwards)."""
    sys.path.insert(0, str(ROOT))
    from scripts.research.fixed_costs import revision_tree as worktree

    return worktree(revision, work)


def described(tree: Path) -> str:
    """The commit a tree is at, "-dirty" where it has uncommitted changes."""
    done = subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def run_worker(label: str, tree: Path, args: argparse.Namespace, profile: bool, out: Path) -> list[dict[str, Any]]:
    """One repeat of every row by a worker process with the code in ``tree``."""
    command = [sys.executable, "-P", "-c", WORKER_BOOT, str(tree), str(SCRIPT), "--worker", str(out), "--code", label]
    command += ["--batches", ",".join(map(str, args.batches)), "--samplers", ",".join(args.samplers), "--paths", ",".join(args.paths)]
    command += ["--window-s", str(args.window_s), "--per-request", str(args.per_request), "--threads", str(args.threads)]
    command += ["--profile"] if profile else []
    done = subprocess.run(command, cwd=tree, stdout=subprocess.DEVNULL, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the worker of {label} ({tree}) failed with exit status {done.returncode} (its error is above)")
    rows: list[dict[str, Any]] = json.loads(out.read_text())
    return rows


def measure(codes: Mapping[str, Path], args: argparse.Namespace, work: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Every repeat of every code, alternating (which code goes first alternates too), op counts on the first; and
    the workers that failed (a code that does not run leaves the other's figures)."""
    runs, failed = [], []
    for repeat in range(args.repeats):
        order = list(codes.items())[:: 1 if repeat % 2 == 0 else -1]
        for label, tree in order:
            print(f"repeat {repeat + 1}/{args.repeats}, {label}:", file=sys.stderr, flush=True)
            out = work / f"rows-{repeat}-{list(codes).index(label)}.json"
            try:
                runs += [{"code": label, **row} for row in run_worker(label, tree, args, repeat == 0, out)]
            except RuntimeError as error:
                print(error, file=sys.stderr, flush=True)
                failed.append(f"repeat {repeat + 1}: {error}")
    return runs, failed


def summarize(runs: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (code, path, sampler, batch): the op counts of its profiled run and the median ms."""
    grouped: dict[tuple[str, str, str, int], list[dict[str, Any]]] = collections.defaultdict(list)
    for run in runs:
        grouped[(run["code"], run["path"], run["sampler"], run["batch"])].append(run)
    rows = []
    for (code, path, sampler, batch), group in grouped.items():
        row: dict[str, Any] = {"code": code, "path": path, "sampler": sampler, "batch": batch}
        errors = sorted({run["error"] for run in group if "error" in run})
        timed = [run for run in group if "error" not in run]
        counted = next((run for run in timed if "torch_ops_per_step" in run), {})
        row |= {key: value for key, value in counted.items() if key.endswith("_per_step") or key == "steps_profiled"}
        row.pop("host_ms_per_step", None)
        if timed:
            ms = [run["host_ms_per_step"] for run in timed]
            row |= {"host_ms_per_step_p50": round(statistics.median(ms), 4), "host_ms_per_step": ms}
            row |= {"steps_timed": [run["steps_timed"] for run in timed], "mean_batch": timed[0].get("mean_batch")}
        logs = sorted({line for run in timed for line in run.get("log", [])})
        rows.append(row | ({"errors": errors} if errors else {}) | ({"log": logs} if logs else {}))
    return rows


def compare(rows: Sequence[dict[str, Any]], against: str) -> list[dict[str, Any]]:
    """Per (path, sampler, batch): now's figures beside ``against``'s, and now's ms as a share of its."""
    by_key = {(r["code"], r["path"], r["sampler"], r["batch"]): r for r in rows}
    pairs = []
    for (code, path, sampler, batch), now in by_key.items():
        then = by_key.get((against, path, sampler, batch))
        if code != "now" or then is None:
            continue
        pair: dict[str, Any] = {"path": path, "sampler": sampler, "batch": batch}
        for key in ("torch_ops_per_step", "kernel_ops_per_step", "host_ms_per_step_p50"):
            pair |= {f"{key} now": now.get(key), f"{key} {against}": then.get(key)}
        if now.get("host_ms_per_step_p50") and then.get("host_ms_per_step_p50"):
            pair["ms_now_over_against"] = round(now["host_ms_per_step_p50"] / then["host_ms_per_step_p50"], 3)
        pairs.append(pair)
    return pairs


def listed(kind: Callable[[str], Any], allowed: Sequence[Any] | None = None) -> Callable[[str], list[Any]]:
    def parse(text: str) -> list[Any]:
        values = [kind(part.strip()) for part in text.split(",") if part.strip()]
        if not values or (allowed is not None and set(values) - set(allowed)):
            raise argparse.ArgumentTypeError(
                f"{text!r}: allowed: a comma-separated list" + (f" of {', '.join(allowed)}" if allowed else "")
            )
        return values

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=listed(int), default=[1, 8, 64, 256], help="samples per step, comma-separated (default: 1,8,64,256)")
    p.add_argument("--samplers", type=listed(str), default=list(SAMPLERS), help=f"comma-separated (default: {','.join(SAMPLERS)})")
    p.add_argument("--paths", type=listed(str, PATHS), default=list(PATHS), help=f"comma-separated (default: {','.join(PATHS)})")
    p.add_argument("--repeats", type=int, default=3, help="timing windows per row, each by a fresh worker process (default: 3)")
    p.add_argument("--window-s", type=float, default=0.4, help="seconds of steps per timing window (default: 0.4)")
    p.add_argument("--per-request", type=int, default=1, help="samples per scheduler request (default: 1)")
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads (default: 1)")
    p.add_argument("--against", metavar="REV", help="also measure this git revision's code, alternating with this one's (e.g. HEAD~1)")
    p.add_argument("--out", type=Path, metavar="DIR", help=f"write DIR/{OUT_FILE} (default: print the JSON)")
    p.add_argument("--worker", metavar="FILE", help=argparse.SUPPRESS)  # one repeat in this process, rows to FILE
    p.add_argument("--code", default="now", help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.repeats < 1 or args.window_s <= 0 or args.per_request < 1 or args.threads < 1 or min(args.batches) < 1:
        p.error("--repeats, --per-request, --threads and every batch: allowed >= 1; --window-s: allowed > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    report: dict[str, Any] = {
        "what": "host ms and torch ops per generation step, the network's compute removed (see the script's docstring)",
        "length": LENGTH,
        "request_steps": REQUEST_STEPS,
        "per_request": args.per_request,
        "threads": args.threads,
        "repeats": args.repeats,
        "window_s": args.window_s,
        "against": args.against,
        "torch": importlib.metadata.version("torch"),
        "load_average": list(os.getloadavg()),
    }
    with tempfile.TemporaryDirectory(prefix="ldlm-host-overhead-") as scratch, contextlib.ExitStack() as stack:
        work = Path(scratch)
        codes = {"now": ROOT} | ({args.against: stack.enter_context(revision_tree(args.against, work))} if args.against else {})
        report["codes"] = {label: described(tree) for label, tree in codes.items()}
        runs, failed = measure(codes, args, work)
    rows = summarize(runs)
    report |= {"load_average_end": list(os.getloadavg()), "rows": rows} | ({"failed_workers": failed} if failed else {})
    if args.against:
        report["comparison"] = compare(rows, args.against)
    text = json.dumps(report, indent=2) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        from ldlm.files import write_atomically

        args.out.mkdir(parents=True, exist_ok=True)
        write_atomically(args.out / OUT_FILE, text)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
