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
batch; lockstep: one plan of ``batch`` samples), and after 5 warm-up steps:

- op counts, from torch.profiler (CPU, every thread) over 6 steps on the thread that steps, each step from one stub
  call to the next (a marker recorded in the stub), the median step's: ``torch_ops_per_step`` counts the
  dispatcher's ``aten::`` ops at top level (not nested in another aten op, so a composite op counts once, not once
  per op it calls); ``kernel_ops_per_step`` those of them that would launch a GPU kernel: the op or an op nested in
  it is not in ``NO_KERNEL_OPS`` (views, metadata, allocations, and wrappers such as aten::to, clone, reshape or
  contiguous, which launch one only through a nested copy_); ``syncs_per_step`` those that wait for the device
  (``SYNC_OPS``: aten::item and the like). For the fused path, ``in_graph_*_per_step``: those of them inside
  ``FusedSteps.run``, the part of a fused step a CUDA graph captures: on a GPU one replay launches them and the
  host dispatches only the rest. The counts are counts: they do not depend on the machine's load. They are those
  of a CPU run: a GPU run's host-to-device copies of host-built tensors do not show here.
- ``host_ms_per_step_p50``: a separate window without the profiler (--window-s, 10 to 400 steps): the wall time
  between the first and the last stub call over the steps between, median over --repeats runs. One intra-op
  thread (--threads), so the figure is the host's, not a thread pool's.
- fused rows: ``in_graph_ms_per_step_p50``, the time inside ``FusedSteps.run`` in that window, and
  ``host_ms_outside_graph_p50``, the rest: the host's work per step where a CUDA graph replays the in-graph part.
- ``mean_batch``: samples per denoiser call over that window (the scheduler's ``samples_stepped`` over its
  ``denoiser_calls``): ``batch`` where every sample ran every step.

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
import itertools
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
WARMUP_STEPS = 5  # past the samplers' history (dpm3m keeps 3 steps, its corrector 1): every step after is alike
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

# --- the worker: one repeat of every row, in this process --------------------------------------------------


class NetworkStub:
    """``CompiledBackend._module_outputs`` without the network: every output is the x0_prev input, and no op
    runs. Each call (one denoiser call) is stamped, marked in a running profile while ``marking``, and tells
    ``wait_for``'s caller; from call ``park_at`` on, the stepping thread waits in the stub (``hold``, ``release``)."""

    def __init__(self, output_names: Sequence[str]) -> None:
        self.outputs = len(output_names)
        self.stamps: list[float] = []
        self.marking = False
        self.park_at: int | None = None
        self.parked = False
        self.changed = threading.Condition()

    def reset(self) -> NetworkStub:
        """No calls yet: the stamps start again."""
        self.stamps = []
        return self

    def __call__(self, tensors: Mapping[str, Tensor]) -> tuple[Tensor, ...]:
        import torch

        self.stamps.append(time.perf_counter())
        if self.marking:
            with torch.profiler.record_function(MARKER):
                pass
        with self.changed:
            self.changed.notify_all()
            while self.park_at is not None and len(self.stamps) >= self.park_at:
                self.parked = True
                self.changed.wait()
            self.parked = False
        return (tensors["x0_prev"],) * self.outputs

    def wait_for(self, calls: int, timeout_s: float) -> bool:
        """Whether ``calls`` calls were made within ``timeout_s``."""
        with self.changed:
            return self.changed.wait_for(lambda: len(self.stamps) >= calls, timeout_s)

    def hold(self, calls: int) -> None:
        """Let the stepping thread make ``calls`` more calls, from where it runs or waits, then wait in the stub;
        returns once it waits there (nothing of it runs while a profile starts or stops)."""
        with self.changed:
            self.park_at = len(self.stamps) + calls
            self.changed.notify_all()
            if not self.changed.wait_for(lambda: self.parked and len(self.stamps) >= self.park_at, TIMEOUT_S):  # type: ignore[operator]
                raise RuntimeError(f"the stepping thread made {len(self.stamps)} calls, not {self.park_at}, in {TIMEOUT_S} s")

    def release(self) -> None:
        with self.changed:
            self.park_at = None
            self.changed.notify_all()


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


@dataclasses.dataclass(eq=False)
class Event:
    """One recorded op or range on one thread (ns), and what it encloses."""

    name: str
    start: int
    end: int
    thread: int
    parent: Event | None = None
    children: list[Event] = dataclasses.field(default_factory=list)


def nest(events: Iterable[Event]) -> list[Event]:
    """``events`` with their parents and children: on one thread, what an op calls opens and closes inside it."""
    ordered = sorted(events, key=lambda e: (e.thread, e.start, -e.end))
    open_events: list[Event] = []
    for event in ordered:
        while open_events and (open_events[-1].thread != event.thread or open_events[-1].end <= event.start):
            open_events.pop()
        if open_events:
            event.parent = open_events[-1]
            event.parent.children.append(event)
        open_events.append(event)
    return ordered


def profiled(stub: NetworkStub, run: Callable[[], Any]) -> list[Event]:
    """The events of every thread while ``run`` runs, the stub marking each denoiser call. Read from the profile's
    raw (Kineto) events: parsed into FunctionEvents, the 60000 events of a few steps at batch 256 take seconds."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    every_thread = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as profiler:
        stub.marking = True
        try:
            run()
        finally:
            stub.marking = False
    raw = profiler.profiler.kineto_results.events()  # type: ignore[union-attr]
    return nest(Event(e.name(), e.start_ns(), e.start_ns() + e.duration_ns(), e.start_thread_id()) for e in raw)


def subtree(event: Event) -> Iterator[str]:
    yield event.name
    for child in event.children:
        yield from subtree(child)


def nested_in(event: Event, within: Callable[[str], bool]) -> bool:
    """Whether an event that encloses ``event`` has a name ``within`` takes."""
    parent = event.parent
    while parent is not None:
        if within(parent.name):
            return True
        parent = parent.parent
    return False


def is_aten(name: str) -> bool:
    return name.startswith("aten::")


def op_counts(ops: Sequence[Event], prefix: str = "") -> dict[str, int]:
    """Top-level ``ops``, and those of them that launch a kernel or wait for the device."""
    kernels = sum(any(is_aten(n) and n not in NO_KERNEL_OPS for n in subtree(e)) for e in ops)
    syncs = sum(any(n in SYNC_OPS for n in subtree(e)) for e in ops)
    return {f"{prefix}torch_ops_per_step": len(ops), f"{prefix}kernel_ops_per_step": kernels, f"{prefix}syncs_per_step": syncs}


def step_counts(events: Sequence[Event], skip: int) -> dict[str, Any]:
    """Top-level aten ops on the stepping thread from each marked denoiser call to the next (after ``skip``): the
    median step's counts (a step cut by the profile's start or end may lose the ranges its ops are nested in)."""
    markers = sorted((e for e in events if e.name == MARKER), key=lambda e: e.start)[skip:]
    if len(markers) < 2 or len({m.thread for m in markers}) != 1:
        raise RuntimeError(f"{len(markers)} denoiser calls were marked on {len({m.thread for m in markers})} threads; need >= 2 on one")
    thread, starts = markers[0].thread, [m.start for m in markers]
    top = [e for e in events if e.thread == thread and is_aten(e.name) and not nested_in(e, is_aten)]
    fused = any(e.name == IN_GRAPH for e in events)  # a fused step: what of it a CUDA graph replays on a GPU
    per_step = []
    for start, end in itertools.pairwise(starts):
        ops = [e for e in top if start <= e.start < end]
        in_graph = op_counts([e for e in ops if nested_in(e, IN_GRAPH.__eq__)], "in_graph_") if fused else {}
        per_step.append(op_counts(ops) | in_graph)
    counts: dict[str, Any] = {key: float(statistics.median(step[key] for step in per_step)) for key in per_step[0]}
    by_name = collections.Counter(e.name for e in top if starts[0] <= e.start < starts[-1])
    top_ops = {name: round(count / len(per_step), 2) for name, count in by_name.most_common(12)}
    steps = {"steps_profiled": len(per_step), "torch_ops_each_step": [step["torch_ops_per_step"] for step in per_step]}
    return counts | steps | {"top_ops_per_step": top_ops}


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


@contextlib.contextmanager
def in_graph_timed(steps: Any) -> Iterator[list[float]]:
    """The seconds of each ``steps.run`` call meanwhile (the part of a fused step a CUDA graph replays on a GPU)."""
    spent: list[float] = []
    run = getattr(steps, "run", None)
    if run is None:
        yield spent
        return

    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return run(*args, **kwargs)
        finally:
            spent.append(time.perf_counter() - started)

    steps.run = timed
    try:
        yield spent
    finally:
        del steps.run


def outside_graph(row: dict[str, Any], spent: Sequence[float]) -> dict[str, Any]:
    """A fused row's host ms per step less its in-graph part: the host's share of a step where a CUDA graph replays."""
    if not spent:
        return {}
    in_graph = 1000 * statistics.mean(spent)
    return {"in_graph_ms_per_step": round(in_graph, 4), "host_ms_outside_graph": round(row["host_ms_per_step"] - in_graph, 4)}


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
                stub.hold(1)  # the profile starts and stops while the stepping thread waits in the stub
                with in_graph_marked(steps):
                    row |= step_counts(profiled(stub, lambda: stub.hold(PROFILE_STEPS + 1)), 0)
                stub.release()
            calls, stepped = scheduler.denoiser_calls, getattr(scheduler, "samples_stepped", None)
            with in_graph_timed(steps) as spent:
                row |= timed_window(stub, options.window_s)
            row |= outside_graph(row, spent)
            if stepped is not None:
                row["mean_batch"] = round((scheduler.samples_stepped - stepped) / (scheduler.denoiser_calls - calls), 2)
            check_requests(futures, scheduler.denoiser_calls, len(stub.stamps))
        finally:
            stub.release()
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
                started = time.perf_counter()
                row = measure_row(stack, path, sampler, batch, options)
                rows.append(row)
                said = row.get("error") or f"{row['host_ms_per_step']:.3f} ms/step, {row.get('torch_ops_per_step', '-')} ops/step"
                took = f"({time.perf_counter() - started:.1f} s)"
                print(f"  {options.code}: {path}, {sampler}, batch {batch}: {said} {took}", file=sys.stderr, flush=True)
    Path(options.worker).write_text(json.dumps(rows))
    return 0


# --- the driver: workers of each code, alternating, and their medians --------------------------------------


def fixed_costs() -> Any:
    """fixed_costs.py, whose git worktree of a revision (``revision_tree``) and way of running a script with a
    worktree's code (``revision_script``) this script shares."""
    sys.path.insert(0, str(ROOT))
    from scripts.research import fixed_costs as module

    return module


def revision_tree(revision: str, work: Path) -> contextlib.AbstractContextManager[Path]:
    """fixed_costs.py's git worktree of ``revision`` (removed afterwards)."""
    return fixed_costs().revision_tree(revision, work)  # type: ignore[no-any-return]


def described(tree: Path) -> str:
    """The commit a tree is at, "-dirty" where it has uncommitted changes."""
    done = subprocess.run(["git", "-C", str(tree), "describe", "--always", "--dirty"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def run_worker(label: str, tree: Path, args: argparse.Namespace, profile: bool, out: Path) -> list[dict[str, Any]]:
    """One repeat of every row by a worker process with the code in ``tree``."""
    command = fixed_costs().revision_script(tree, SCRIPT, "--worker", str(out), "--code", label)
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
        row |= {
            key: value
            for key, value in counted.items()
            if key.endswith("_per_step") or key.startswith(("steps_profiled", "torch_ops_each"))
        }
        row.pop("host_ms_per_step", None)
        if timed:
            ms = [run["host_ms_per_step"] for run in timed]
            row |= {"host_ms_per_step_p50": round(statistics.median(ms), 4), "host_ms_per_step": ms}
            row |= {"steps_timed": [run["steps_timed"] for run in timed], "mean_batch": timed[0].get("mean_batch")}
            for key in ("in_graph_ms_per_step", "host_ms_outside_graph"):
                if all(key in run for run in timed):
                    row[f"{key}_p50"] = round(statistics.median(run[key] for run in timed), 4)
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
        for key in ("torch_ops_per_step", "kernel_ops_per_step", "host_ms_per_step_p50", "host_ms_outside_graph_p50"):
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
    p.add_argument("--repeats", type=int, default=5, help="timing windows per row, each by a fresh worker process (default: 5)")
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
