#!/usr/bin/env python3
"""Which guards does no test trigger? Every ``raise`` and every bound/limit branch of ldlm/, export/
and serve/, against the lines and branches the test suite executes (coverage.py, branch coverage).

A guard that no test triggers can be deleted and every test still passes (e.g. RMSNorm's eps,
the end-of-text cut, the NaN refusal). This script finds them:

  raises     every ``ast.Raise`` node: executed or not (coverage's executed lines), with the
             enclosing function, the exception and the first line of its message;
  branches   every ``if`` whose test is an ordering comparison (``<``, ``<=``, ``>``, ``>=``: a bound
             or a limit) and whose body does not raise: the branch arcs that never ran.

Raises that cannot run on this machine (a GPU, TensorRT, Triton's Python backend) or that guard an
internal invariant rather than user input or an artifact are listed in ``NOT_HERE`` with the reason;
they are reported apart. Whatever remains unexecuted is a gap to close with a test.

    flock /tmp/ldlm-cpu.lock .venv/bin/python tests/tools/guard_coverage.py --run      # the suite under coverage, then the report
    .venv/bin/python tests/tools/guard_coverage.py --data runs/guard-coverage/.coverage  # report from an earlier run
    .venv/bin/python tests/tools/guard_coverage.py --run -- tests/serve/api/test_kserve_values.py  # part of the suite

Writes ``--out`` (JSON) and the same path with ``.md`` (the summary). Not part of CI: it runs the
whole suite under coverage's tracer (589 s on the project's 2-core machine, 2026-12-01), and needs
coverage.py >= 7.10 (``pip install coverage``), which CI does not install.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ldlm", "export", "serve")
ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)

# Raises that the suite cannot execute on a CPU machine, or that guard an invariant no input can
# break. Key: "path::function::text" where text is a substring of the raise's source; value: the
# reason. Checked by ``classify``: a key that matches no raise is reported as stale.
GPU = (
    "needs a CUDA GPU and a failing TensorRT call (execute, context, profile, capture): no input of ours provokes it, "
    "and scripts/research/gpu_check.py runs only the paths that succeed"
)
DESERIALIZE = (
    "needs a CUDA GPU: TensorRT deserializes plans only there; a corrupt plan whose sha256 matches its manifest would "
    "reach it (not written: this task had no GPU)"
)
TRT_BUILD = "a TensorRT build that fails: the message carries TensorRT's own errors; every ONNX we export builds"
NOT_HERE: dict[str, str] = {
    "ldlm/device.py::resolve_device::cuda:0..cuda:": "needs a CUDA GPU: cuda:N at or above its device count (on CPU the check "
    "before it answers, tested)",
    "serve/runtime/backends.py::OrtBackend.__init__::could not start": "needs onnxruntime-gpu whose CUDA/TensorRT provider fails to start; "
    "the CPU build lists no such provider, so the check before it refuses first (tested)",
    "serve/runtime/trt_runtime.py::TensorRTEngine.__init__::could not load": DESERIALIZE,
    "serve/runtime/trt_runtime.py::TensorRTEngine.__init__::could not deserialize": DESERIALIZE,
    "serve/runtime/tensorrt_executor.py::PlanExecutor._execute_plain::execute_async_v3 failed": GPU,
    "serve/runtime/tensorrt_executor.py::PlanExecutor._context::could not create an execution context": GPU,
    "serve/runtime/tensorrt_executor.py::PlanExecutor._context::could not select optimization profile": GPU,
    "serve/runtime/tensorrt_executor.py::PlanExecutor._capture::during the CUDA graph warm-up": GPU,
    "serve/runtime/tensorrt_executor.py::PlanExecutor._capture::during CUDA graph capture": GPU,
    "export/layernorm/eps_probe_trt.py::run_normalization_plan::could not deserialize": DESERIALIZE,
    "export/layernorm/eps_probe_trt.py::run_normalization_plan::execute_async_v3 failed": GPU,
    "export/engine_builder.py::build_plan::could not build": TRT_BUILD,
    "export/layernorm/trt_network.py::build_normalization_plan::could not build": TRT_BUILD,
    "export/onnx_export.py::export_graph::returned no program": "torch.onnx.export returning None: a torch failure, not an input",
    "export/onnx_export.py::export_graphs::cannot write to": "a PermissionError: the suite runs as root, who may write anywhere "
    "(a read-only mount answers EROFS or EPERM depending on the machine); the NotADirectoryError branch beside it is tested",
}


@dataclass
class RaiseSite:
    path: str
    line: int
    function: str  # enclosing qualname, "<module>" at the top
    exception: str  # the raised expression's callee or name
    text: str  # first line of the raise statement
    executed: bool
    reason: str | None = None  # why it may stay unexecuted (NOT_HERE), None: it should be tested


@dataclass
class BranchSite:
    path: str
    line: int
    function: str
    test: str  # the if's condition
    missing: list[int]  # destination lines (negative: exits) never reached from the if


def source_files(root: Path) -> list[Path]:
    return sorted(p for package in PACKAGES for p in (root / package).rglob("*.py"))


class _Walker(ast.NodeVisitor):
    """Raise nodes and ordering ifs, each with its enclosing function's qualname."""

    def __init__(self) -> None:
        self.scope: list[str] = []
        self.raises: list[tuple[ast.Raise, str]] = []
        self.ifs: list[tuple[ast.If, str]] = []

    def _scoped(self, node: ast.AST, name: str) -> None:
        self.scope.append(name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._scoped(node, node.name)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._scoped(node, node.name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._scoped(node, node.name)

    def visit_Raise(self, node: ast.Raise) -> None:
        self.raises.append((node, ".".join(self.scope) or "<module>"))
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        ordering = any(isinstance(op, ORDERING) for c in ast.walk(node.test) if isinstance(c, ast.Compare) for op in c.ops)
        raises = any(isinstance(n, ast.Raise) for stmt in node.body for n in ast.walk(stmt))
        if ordering and not raises:
            self.ifs.append((node, ".".join(self.scope) or "<module>"))
        self.generic_visit(node)


def _exception_name(node: ast.Raise) -> str:
    exc = node.exc
    if exc is None:
        return "(re-raise)"
    target = exc.func if isinstance(exc, ast.Call) else exc
    return ast.unparse(target)


def analyse(data_file: Path, root: Path = ROOT) -> tuple[list[RaiseSite], list[BranchSite]]:
    import coverage

    cov = coverage.Coverage(data_file=str(data_file))
    cov.load()
    measured = {os.path.realpath(f) for f in cov.get_data().measured_files()}
    raises, branches = [], []
    for path in source_files(root):
        rel = str(path.relative_to(root))
        text = path.read_text()
        lines = text.splitlines()
        walker = _Walker()
        walker.visit(ast.parse(text))
        if os.path.realpath(path) in measured:
            analysis = cov._analyze(str(path))  # coverage's own statement and arc analysis (private but long stable)
            executed = set(analysis.executed)
            missing_arcs = analysis.missing_branch_arcs() if analysis.has_arcs else {}
        else:
            executed, missing_arcs = set(), {}
        for node, function in walker.raises:
            raises.append(
                RaiseSite(rel, node.lineno, function, _exception_name(node), lines[node.lineno - 1].strip(), node.lineno in executed)
            )
        for node, function in walker.ifs:
            if node.lineno not in executed:
                continue  # a function no test calls: its raises say more than its branches
            if missing_arcs.get(node.lineno):
                branches.append(BranchSite(rel, node.lineno, function, ast.unparse(node.test)[:120], sorted(missing_arcs[node.lineno])))
    return raises, branches


def classify(raises: list[RaiseSite], root: Path = ROOT) -> list[str]:
    """Attach NOT_HERE reasons; return the keys that match no raise (stale entries)."""
    used = set()
    for site in raises:
        block = _statement_source(root / site.path, site.line)
        for key, reason in NOT_HERE.items():
            path, function, snippet = key.split("::", 2)
            if path == site.path and function == site.function and snippet in block:
                site.reason = reason
                used.add(key)
                break
    return sorted(set(NOT_HERE) - used)


def _statement_source(path: Path, line: int) -> str:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.lineno == line:
            return ast.get_source_segment(path.read_text(), node) or ""
    return ""


def run_suite(data_file: Path, pytest_args: list[str]) -> float:
    """The suite under coverage with branch measurement, subprocesses included; returns seconds."""
    data_file.parent.mkdir(parents=True, exist_ok=True)
    for old in data_file.parent.glob(data_file.name + "*"):
        old.unlink()
    rc = data_file.parent / "coveragerc"
    sources = ", ".join(str(ROOT / p) for p in PACKAGES)
    rc.write_text(
        f"[run]\nbranch = True\nparallel = True\ndata_file = {data_file}\nsource = {sources}\n"
        "patch = subprocess\nconcurrency = thread, multiprocessing\nsigterm = True\n"
    )
    env = {**os.environ, "COVERAGE_RCFILE": str(rc)}
    python = ROOT / ".venv" / "bin" / "python"
    started = time.perf_counter()
    done = subprocess.run(
        [
            str(python),
            "-m",
            "coverage",
            "run",
            f"--rcfile={rc}",
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *(pytest_args or ["tests"]),
        ],
        cwd=ROOT,
        env=env,
    )
    seconds = time.perf_counter() - started
    subprocess.run([str(python), "-m", "coverage", "combine", f"--rcfile={rc}", "--keep", "-q"], cwd=ROOT, env=env, check=True)
    print(f"pytest exit status {done.returncode} after {seconds:.0f} s (under coverage)", flush=True)
    return seconds


def markdown(report: dict) -> str:
    r = report
    out = [
        f"# Guard coverage ({r['date']})",
        "",
        (
            f"Suite run under coverage.py (branch) in {r['suite_seconds']:.0f} s: `{r['command']}`."
            if r["suite_seconds"] == r["suite_seconds"]
            else f"From coverage data of an earlier run: `{r['command']}`."
        ),
        "",
        f"- raise statements in ldlm/, export/, serve/: **{r['raises']}**; executed by a test: **{r['raises_executed']}**",
        f"- not executed, with a reason they cannot run here (listed below): {len(r['not_here'])}",
        f"- not executed and no reason: **{len(r['untested'])}** (each a gap: a guard no test triggers)",
        f"- ordering `if`s (bounds, limits) with a branch never taken: {len(r['branches'])}",
        "",
    ]
    if r["untested"]:
        out += ["## Untested raises", "", "| file:line | function | raise |", "|---|---|---|"]
        out += [f"| {s['path']}:{s['line']} | {s['function']} | `{s['text'][:90]}` |" for s in r["untested"]]
        out.append("")
    out += ["## Not executed here, and why", "", "| file:line | function | raise | reason |", "|---|---|---|---|"]
    out += [f"| {s['path']}:{s['line']} | {s['function']} | `{s['text'][:70]}` | {s['reason']} |" for s in r["not_here"]]
    out += ["", "## Bound/limit branches never taken", "", "| file:line | function | condition | missing arcs |", "|---|---|---|---|"]
    out += [f"| {b['path']}:{b['line']} | {b['function']} | `{b['test'][:80]}` | {b['missing']} |" for b in r["branches"]]
    if r["stale_reasons"]:
        out += ["", "## Stale NOT_HERE entries (match no raise)", ""] + [f"- `{k}`" for k in r["stale_reasons"]]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="store_true", help="run the suite under coverage first (else read --data)")
    parser.add_argument(
        "--data", default="runs/guard-coverage/.coverage", help="coverage data file (default: runs/guard-coverage/.coverage)"
    )
    parser.add_argument("--out", default="runs/guard-coverage/guard-coverage.json", help="JSON report; the summary goes next to it as .md")
    parser.add_argument("--date", default=time.strftime("%Y-%m-%d"), help="date shown in the summary")
    parser.add_argument("pytest_args", nargs="*", help="after --: pytest arguments (default: tests)")
    args = parser.parse_args(argv)
    data_file = (ROOT / args.data).resolve()
    seconds = run_suite(data_file, args.pytest_args) if args.run else float("nan")
    if not data_file.exists():
        parser.error(f"--data {args.data}: no coverage data; run with --run first")
    raises, branches = analyse(data_file)
    stale = classify(raises)
    untested = [s for s in raises if not s.executed and s.reason is None]
    report = {
        "date": args.date,
        "suite_seconds": seconds,
        "command": "tests/tools/guard_coverage.py --run " + " ".join(args.pytest_args)
        if args.run
        else f"tests/tools/guard_coverage.py --data {args.data}",
        "raises": len(raises),
        "raises_executed": sum(s.executed for s in raises),
        "untested": [asdict(s) for s in untested],
        "not_here": [asdict(s) for s in raises if not s.executed and s.reason is not None],
        "executed_but_listed_not_here": [asdict(s) for s in raises if s.executed and s.reason is not None],
        "branches": [asdict(b) for b in branches],
        "stale_reasons": stale,
    }
    out = (ROOT / args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(
        f"{report['raises_executed']}/{report['raises']} raises executed; {len(untested)} untested without a reason; "
        f"{len(report['not_here'])} not runnable here; {len(branches)} bound branches with an arc never taken"
    )
    for s in untested:
        print(f"  UNTESTED {s.path}:{s.line} {s.function}: {s.text[:100]}")
    print(f"report: {out} and {out.with_suffix('.md')}")
    return 1 if untested or stale else 0


if __name__ == "__main__":
    sys.exit(main())
