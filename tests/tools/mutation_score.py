#!/usr/bin/env python3
"""The hot path's mutation score, by mutmut: every mutant its operators make in the modules of ``SHARDS``,
each run against the tests that call the mutated function, and a JSON report per module.

mutmut 3 copies the sources to ``mutants/``, records which tests call each function, then runs only those
tests per mutant in a process forked from a warm one: the cost that fits two cores. Each shard (a group of
modules that share their tests) runs in its own working directory under ``.cache/mutation/SHARD``: links to
this checkout, the project's pyproject.toml with the shard's ``[tool.mutmut]`` section, and mutmut's
``mutants/``, where its results stay between runs, so a run stopped part way goes on where it stopped.

Two things this layout needs that mutmut cannot know:
- ``ldlm.serve`` and ``ldlm.export`` are mapped from ``serve/`` and ``export/`` (pyproject's package-dir). Inside
  ``mutants/`` the package ``ldlm`` has no such folders, so Python would fall through to the editable
  install's finder and import this checkout's unmutated files: a score of tests run against code nobody
  mutated. ``mutants/ldlm/serve`` and ``mutants/ldlm/export`` are links to the mutated copies, and every
  run first checks that a planted mutant of each shard is the code its tests import (``check_mapping``).
- Message text: a refusal's wording is pinned where a user reads it, but a mutant that inserts ``XX`` into
  every f-string would double the count without pinning behaviour. Statements that only raise or log (their
  message) are left out by ``do_not_mutate_patterns``; the report counts them per module.

A survivor that changes nothing observable is listed in ``mutation_equivalents.txt`` beside this file, one
line each: ``MUTANT_NAME  why``. The report counts it as equivalent, and names listed mutants that no longer
survive (their entries are stale).

    .venv/bin/python tests/tools/mutation_score.py                     # every shard, then the report
    .venv/bin/python tests/tools/mutation_score.py --shard limits      # one shard (others' results kept)
    .venv/bin/python tests/tools/mutation_score.py --report-only       # the report from the results so far

Not part of CI (an hour and more on two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / ".cache" / "mutation"
EQUIVALENTS = Path(__file__).with_name("mutation_equivalents.txt")
LINKED = ("ldlm", "export", "serve", "tests", "docs", "models", "scripts", "README.md")
# A statement that raises or logs carries a message: left out of mutation (see the module's docstring).
MESSAGE_PATTERNS = (r"^\s*raise \w+(\.\w+)*\(", r"^\s*log\.\w+\(")
TIMEOUT_MULTIPLIER, TIMEOUT_CONSTANT_S = 4.0, 10.0
KILLED, SURVIVED, TIMEOUT, NO_TESTS = "killed", "survived", "timeout", "no tests"


@dataclass(frozen=True)
class Shard:
    name: str
    modules: tuple[str, ...]  # source files, relative to the repository root
    tests: tuple[str, ...]  # what pytest collects for this shard (files or folders)


S, R, A = "tests/ldlm/sampling/", "tests/serve/runtime/", "tests/serve/api/"
# One shard per module, each with the tests of its behaviour (a glob is expanded against the checkout): mutmut
# runs every test that calls a mutated function, so a wide selection makes each surviving mutant cost minutes.
SHARDS: tuple[Shard, ...] = (
    Shard(
        "slots",
        ("ldlm/sampling/slots.py",),
        (S + "test_slots*.py", S + "test_loop_fused.py", R + "test_scheduler_fused.py"),
    ),
    Shard(
        "delivery",
        ("serve/runtime/delivery.py",),
        (R + "test_delivery_*.py", R + "test_scheduler.py", R + "test_scheduler_cancellation.py"),
    ),
    Shard("scheduler", ("serve/runtime/scheduler.py",), (R + "test_scheduler*.py", R + "test_admission.py")),
    Shard("admission", ("serve/runtime/admission.py",), (R + "test_admission*.py", R + "test_scheduler_queue*.py")),
    Shard(
        "policy", ("serve/runtime/policy.py",), (R + "test_scheduler.py", R + "test_scheduler_fairness.py", R + "test_scheduler_values.py")
    ),
    Shard("step", ("ldlm/sampling/step.py",), (S + "test_loop_fused.py", S + "test_slots.py", R + "test_torch_backends_fused.py")),
    Shard("loop", ("ldlm/sampling/loop.py",), (S + "test_loop.py", S + "test_loop_fused.py", S + "test_loop_p*.py", S + "test_slots*.py")),
    Shard("request", ("ldlm/sampling/request.py",), (S + "test_loop.py", S + "test_loop_p*.py", R + "test_scheduler_values.py")),
    Shard(
        "samplers",
        ("ldlm/sampling/samplers.py",),
        (S + "test_samplers.py", S + "test_schedule.py", S + "test_slots.py", S + "test_loop.py"),
    ),
    Shard("grpc-generate", ("serve/api/grpc_generate.py",), (A + "test_grpc_generate*.py", A + "test_streaming_edges.py")),
    Shard(
        "streaming",
        ("serve/api/streaming.py",),
        (A + "test_streaming_previews.py", A + "test_streaming_edges.py", A + "test_grpc_generate*.py"),
    ),
    Shard(
        "parity-inputs",
        ("serve/checks/parity_inputs.py",),
        ("tests/serve/checks/test_parity_inputs.py", "tests/ldlm/cli/test_checks_replay.py"),
    ),
    Shard("files", ("ldlm/files.py",), ("tests/ldlm/test_files*.py",)),
    Shard(
        "limits",
        ("ldlm/limits.py",),
        (
            "tests/ldlm/test_limits.py",
            "tests/ldlm/cli/test_cli_ranges.py",
            A + "test_kserve_ranges.py",
            "tests/e2e/test_bounds_every_path.py",
        ),
    ),
    Shard("batcher", ("serve/runtime/batcher.py",), (R + "test_batcher_*.py",)),
    Shard(
        "kserve-tensors",
        ("serve/api/kserve_tensors.py",),
        (A + "test_kserve_bytes.py", A + "test_kserve_values.py", A + "test_kserve_guards.py", A + "test_grpc_kserve_body.py"),
    ),
    Shard("grpc-tensors", ("serve/api/grpc_tensors.py",), (A + "test_kserve_bytes.py", A + "test_grpc_kserve_body.py")),
    Shard(
        "kserve-models", ("serve/api/kserve_models.py",), (A + "test_grpc_kserve*.py", A + "test_kserve_*.py", A + "test_generate_model.py")
    ),
    Shard("grpc-kserve", ("serve/api/grpc_kserve.py",), (A + "test_grpc_kserve*.py", A + "test_grpc_server.py")),
    Shard("openai", ("serve/api/routes/openai.py",), ("tests/serve/api/routes/test_openai*.py",)),
    Shard("tracing", ("serve/runtime/tracing.py",), (R + "test_tracing_*.py",)),
)


def module_name(path: str) -> str:
    """The import name of a source file under pyproject's package-dir mapping: serve/api/x.py -> ldlm.serve.api.x."""
    parts = Path(path).with_suffix("").parts
    return ".".join(parts if parts[0] == "ldlm" else ("ldlm", *parts))


def test_paths(shard: Shard) -> list[str]:
    """The shard's test files, its globs expanded against the checkout (a glob matching nothing is an error)."""
    paths = []
    for pattern in shard.tests:
        found = sorted(str(path.relative_to(ROOT)) for path in ROOT.glob(pattern))
        if not found:
            raise SystemExit(f"[{shard.name}] no test file matches {pattern}")
        paths += [path for path in found if path not in paths]
    return paths


def shard_config(shard: Shard) -> str:
    """This project's pyproject.toml (pytest reads its options from it inside ``mutants/``) with the shard's section."""
    section = {
        "source_paths": [installed(module) for module in shard.modules],
        "also_copy": [name for name in LINKED if name != "tests"],
        "do_not_mutate_patterns": list(MESSAGE_PATTERNS),
        "pytest_add_cli_args": ["-p", "no:xdist", "-p", "no:cacheprovider"],
        # Each mutant's tests run in a child of a fork server that has collected the tests but run none. A child
        # forked from the process that ran them (mutmut's default) inherits torch's BLAS pool and the tests'
        # threads mid-flight, and hangs in its first matrix product: a "timeout" the code under test never caused.
        "process_isolation": "forkserver",
        # mutmut would otherwise start a shard over whenever any file that is not Python changed in git (a doc, this
        # folder's list of equivalents); a changed source function reruns its own mutants all the same
        "use_git_change_detection": False,
        "pytest_add_cli_args_test_selection": test_paths(shard),
        # A mutant is stuck once it runs (its tests' time + TIMEOUT_CONSTANT_S) x TIMEOUT_MULTIPLIER. The constant is the
        # forked pytest's own start (collection, the module's fixtures), which the tests' recorded times leave out:
        # without it a mutant that a test kills a few seconds in reads as a timeout. mutmut's default multiplier, 15,
        # would let one stuck mutant of a shard whose tests take a minute hold a core for a quarter of an hour.
        "timeout_multiplier": TIMEOUT_MULTIPLIER,
        "timeout_constant": TIMEOUT_CONSTANT_S,
    }
    lines = [f"{key} = {json.dumps(value)}" for key, value in section.items()]
    return (ROOT / "pyproject.toml").read_text() + "\n[tool.mutmut]\n" + "\n".join(lines) + "\n"


def installed(path: str) -> str:
    """A source file's path as the package installs it (serve/api/x.py -> ldlm/serve/api/x.py): mutmut names each
    mutant by its file's path, and the tests record calls by import name, so the two must agree."""
    return path if path.startswith("ldlm/") else f"ldlm/{path}"


def prepare(shard: Shard) -> Path:
    """The shard's working directory: links to the checkout, with ``ldlm/`` laid out as installed (its own files,
    ``serve/`` and ``export/``), its config, and the links that make ``ldlm.serve`` and ``ldlm.export`` inside
    ``mutants/`` the mutated copies (see the module's docstring)."""
    work = WORK / shard.name
    (work / "mutants" / "ldlm").mkdir(parents=True, exist_ok=True)
    for name in LINKED:
        link = work / name
        if name != "ldlm" and not link.is_symlink():
            link.symlink_to(ROOT / name)
    package = work / "ldlm"
    if package.is_symlink():
        package.unlink()
    package.mkdir(exist_ok=True)
    for entry in [*(ROOT / "ldlm").iterdir(), ROOT / "serve", ROOT / "export"]:
        link = package / entry.name
        if not link.is_symlink() and entry.name != "__pycache__":
            link.symlink_to(entry)
    (work / "pyproject.toml").write_text(shard_config(shard))
    for name in ("serve", "export"):
        (work / "mutants" / name).mkdir(exist_ok=True)  # mutmut copies into the link before it copies the folder
        link = work / "mutants" / "ldlm" / name
        if not link.is_symlink():
            link.symlink_to(Path("..") / name)
    return work


def check_mapping(work: Path, shard: Shard) -> dict[str, str]:
    """Where each module of the shard is imported from inside ``mutants/``, as the tests import it: a module
    found outside ``mutants/`` (the checkout's unmutated file) or without mutmut's trampolines fails the run."""
    code = (
        "import importlib, json, sys; sys.path.insert(0, '.'); "
        "print(json.dumps({m: importlib.import_module(m).__file__ for m in sys.argv[1:]}))"
    )
    names = [module_name(path) for path in shard.modules]
    found = json.loads(
        subprocess.run([sys.executable, "-c", code, *names], cwd=work / "mutants", capture_output=True, text=True, check=True).stdout
    )
    for name, file in found.items():
        resolved = Path(file).resolve()
        if not resolved.is_relative_to((work / "mutants").resolve()) or "__mutmut_" not in resolved.read_text():
            raise SystemExit(
                f"{name} is imported from {file}, not from a mutated copy under {work / 'mutants'}: the score would be of unmutated code"
            )
    return {name: str(Path(file).resolve().relative_to(work.resolve())) for name, file in found.items()}


def survivors(shard: Shard, timeouts: bool = False) -> list[str]:
    """The shard's mutants that no test killed so far, but those listed as equivalent (they would survive again);
    with ``timeouts``, also those that ran out of time (on a loaded machine a slow test can, a mutant's kill
    unproven)."""
    work, listed, again = WORK / shard.name, equivalents(), (SURVIVED, NO_TESTS, TIMEOUT) if timeouts else (SURVIVED, NO_TESTS)
    return sorted(
        name for module in shard.modules for name, status in statuses(work, module).items() if status in again and name not in listed
    )


def run_shard(shard: Shard, children: int, only_survivors: bool = False, timeouts: bool = False) -> float:
    """mutmut over one shard (or only its survivors, against tests added since); its results stay in the shard's
    ``mutants/``. Returns the seconds it took."""
    work = prepare(shard)
    names = survivors(shard, timeouts) if only_survivors else []
    if only_survivors and not names:
        return 0.0
    before = {module: exit_codes(work, module) for module in shard.modules}
    started = time.monotonic()
    print(f"[{shard.name}] mutmut run over {', '.join(shard.modules)} ({len(shard.tests)} test paths)", flush=True)
    # mutmut draws a spinner on stdout; its own log goes to the shard's folder, the summary to ours
    with open(work / "mutmut-run.log", "w") as log:
        code = subprocess.run(
            [str(Path(sys.executable).with_name("mutmut")), "run", "--max-children", str(children), *names],
            cwd=work,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},  # one thread a mutant: --children of them at once
        ).returncode
    seconds = time.monotonic() - started
    if code != 0:
        tail = (work / "mutmut-run.log").read_text(errors="replace")[-2000:]
        raise SystemExit(f"[{shard.name}] mutmut failed (exit {code}) after {seconds:.0f} s; the end of its log:\n{tail}")
    check_mapping(work, shard)
    if names:
        keep_verdicts(work, shard, before)
    print(f"[{shard.name}] done in {seconds:.0f} s", flush=True)
    return seconds


def exit_codes(work: Path, module: str) -> dict[str, int | None]:
    meta = work / "mutants" / f"{installed(module)}.meta"
    return json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}


def keep_verdicts(work: Path, shard: Shard, before: dict[str, dict[str, int | None]]) -> None:
    """A run of named mutants leaves every other mutant of the file unchecked (mutmut writes its results file anew):
    the verdicts they had before come back, the named ones keep their new ones."""
    for module in shard.modules:
        meta = work / "mutants" / f"{installed(module)}.meta"
        data = json.loads(meta.read_text())
        codes = data["exit_code_by_key"]
        for name, code in before[module].items():
            if codes.get(name, code) is None and code is not None:
                codes[name] = code
        meta.write_text(json.dumps(data, indent=4))


# Run inside a shard's directory, where mutmut reads its configuration: each survivor's diff, and per module how
# many mutants the message patterns left out (mutants made with the patterns and without, from the same source).
FACTS = """
import json, sys
from mutmut.configuration import config
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.mutation.file_mutation import mutate_file_contents
modules, survivors = json.loads(sys.argv[1])
diffs = {name: get_diff_for_mutant(name, path=path) for name, path in survivors}
counts = {}
for path in modules:
    source = open(path).read()
    with_patterns = len(mutate_file_contents(path, source).mutant_names)
    config().do_not_mutate_patterns = []
    counts[path] = len(mutate_file_contents(path, source).mutant_names) - with_patterns
    config().do_not_mutate_patterns = list(json.loads(sys.argv[2]))
print(json.dumps({"diffs": diffs, "left_out": counts}))
"""


def statuses(work: Path, module: str) -> dict[str, str]:
    """Each mutant of ``module`` (a source path) and mutmut's verdict on it, from the shard's results."""
    from mutmut.stats import status_by_exit_code

    meta = work / "mutants" / f"{installed(module)}.meta"
    if not meta.exists():
        return {}
    codes = json.loads(meta.read_text())["exit_code_by_key"]
    return {name: status_by_exit_code[code] for name, code in codes.items()}


def equivalents() -> dict[str, str]:
    """``mutation_equivalents.txt``: mutant name -> why it changes nothing observable."""
    listed = {}
    for line in EQUIVALENTS.read_text().splitlines() if EQUIVALENTS.exists() else []:
        if line.strip() and not line.startswith("#"):
            name, _, why = line.strip().partition(" ")
            listed[name] = why.strip()
    return listed


def module_report(module: str, verdicts: dict[str, str], facts: dict, listed: dict[str, str]) -> dict:
    """One module's counts and score: a timeout counts as killed; a survivor listed as equivalent is left out of
    the score; a mutant no test calls counts as a survivor (nothing would notice it)."""
    survived = sorted(name for name, status in verdicts.items() if status in (SURVIVED, NO_TESTS) and name not in listed)
    counts = {status: sum(1 for value in verdicts.values() if value == status) for status in sorted(set(verdicts.values()))}
    equivalent = sorted(name for name, status in verdicts.items() if name in listed and status in (SURVIVED, NO_TESTS))
    killed = counts.get(KILLED, 0) + counts.get(TIMEOUT, 0)
    scored = killed + len(survived)
    return {
        "module": module_name(module),
        "file": module,
        "mutants": len(verdicts),
        "verdicts": counts,
        "equivalent": len(equivalent),
        "not_run": sum(1 for value in verdicts.values() if value == "not checked"),
        "score": round(killed / scored, 4) if scored else None,
        "message_mutants_left_out": facts["left_out"].get(installed(module), 0),
        "survivors": [{"mutant": name, "status": verdicts[name], "diff": facts["diffs"].get(name, "")} for name in survived],
        "equivalents": [{"mutant": name, "why": listed[name]} for name in equivalent],
        "stale_equivalents": sorted(
            name for name in listed if name.startswith(module_name(module) + ".") and verdicts.get(name) not in (SURVIVED, NO_TESTS)
        ),
    }


def shard_report(shard: Shard, listed: dict[str, str]) -> list[dict]:
    work = prepare(shard)
    verdicts = {module: statuses(work, module) for module in shard.modules}
    survivors = [
        (name, installed(module)) for module in shard.modules for name, status in verdicts[module].items() if status in (SURVIVED, NO_TESTS)
    ]
    facts = json.loads(
        subprocess.run(
            [
                sys.executable,
                "-c",
                FACTS,
                json.dumps([[installed(module) for module in shard.modules], survivors]),
                json.dumps(MESSAGE_PATTERNS),
            ],
            cwd=work,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    return [module_report(module, verdicts[module], facts, listed) for module in shard.modules]


def shard_seconds(shard: Shard) -> float | None:
    path = WORK / shard.name / "seconds.json"
    return json.loads(path.read_text())["seconds"] if path.exists() else None


def write_report(out: Path, shards: tuple[Shard, ...]) -> dict:
    """The JSON report over every shard run so far (a shard not yet run is listed as such)."""
    from importlib.metadata import version

    listed = equivalents()
    modules, runs = [], []
    for shard in shards:
        seconds = shard_seconds(shard)
        runs.append({"shard": shard.name, "modules": list(shard.modules), "tests": list(shard.tests), "seconds": seconds})
        if seconds is not None:
            modules += shard_report(shard, listed)
    report = {
        "tool": f"mutmut {version('mutmut')}",
        "command": ".venv/bin/python tests/tools/mutation_score.py",
        "cores": os.cpu_count(),
        "message_patterns_left_out": list(MESSAGE_PATTERNS),
        "scoring": "score = (killed + timeout) / (killed + timeout + survived + no tests), equivalents left out",
        "shards": runs,
        "modules": modules,
    }
    out.write_text(json.dumps(report, indent=1) + "\n")
    return report


def print_table(report: dict, out: Path) -> None:
    print(f"{'module':44} {'mutants':>7} {'killed':>6} {'timeout':>7} {'survived':>8} {'no tests':>8} {'equiv':>5} {'score':>6}")
    for row in report["modules"]:
        v = row["verdicts"]
        score = "-" if row["score"] is None else f"{row['score']:.1%}"
        print(
            f"{row['module']:44} {row['mutants']:7} {v.get(KILLED, 0):6} {v.get(TIMEOUT, 0):7} "
            f"{len([s for s in row['survivors'] if s['status'] == SURVIVED]):8} {len([s for s in row['survivors'] if s['status'] == NO_TESTS]):8} "
            f"{row['equivalent']:5} {score:>6}"
        )
    print(f"report: {out}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    names = [shard.name for shard in SHARDS]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shard", action="append", choices=names, help="run only these shards (repeatable; default: all)")
    parser.add_argument("--children", type=int, default=2, help="mutants run at once (default: 2, this machine's cores)")
    parser.add_argument("--report-only", action="store_true", help="run nothing: write the report from the results so far")
    parser.add_argument("--survivors", action="store_true", help="run again only the mutants no test killed (after adding tests)")
    parser.add_argument("--timeouts", action="store_true", help="with --survivors: also the mutants that ran out of time")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "docs" / "measurements" / f"mutation-score-cpu-{date.today()}.json", help="the JSON report"
    )
    args = parser.parse_args(argv)
    if args.children < 1:
        parser.error(f"--children {args.children}: allowed: 1 or more")
    if args.timeouts and not args.survivors:
        parser.error("--timeouts: allowed only with --survivors")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = tuple(shard for shard in SHARDS if not args.shard or shard.name in args.shard)
    if not args.report_only:
        for shard in chosen:
            seconds = run_shard(shard, args.children, only_survivors=args.survivors, timeouts=args.timeouts)
            (WORK / shard.name / "seconds.json").write_text(json.dumps({"seconds": round(seconds + (shard_seconds(shard) or 0), 1)}))
    report = write_report(args.out, SHARDS)
    print_table(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
