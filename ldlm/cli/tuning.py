"""``ldlm tune-schedule``: search a checkpoint's step grids and write its schedules.json (ldlm/training/grid_search.py)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ldlm.cli.options import capped_positive_int, capped_positive_int_list, in_range, int_in, seed_int
from ldlm.limits import MAX_N, MAX_STEPS, THREADS
from ldlm.model.config import DEFAULT_TUNING_OBJECTIVE, SAMPLERS, TUNING_OBJECTIVES

if TYPE_CHECKING:  # for the annotations only: the CLI loads torch per command
    from ldlm.model.config import LDLMConfig
    from ldlm.pipeline import LDLMPipeline
    from ldlm.sampling.tuned_grids import TunedGrid, TunedSchedules

MAX_EVALUATIONS = 100_000  # sampling runs per step count: hours even on tiny


def _cmd_tune_schedule(args: argparse.Namespace) -> None:
    # per command, not at the top: building the parser (`ldlm --help`) imports no torch
    import torch

    from ldlm.model.checkpoint import WEIGHTS_FILE, load_config
    from ldlm.sampling.tuned_grids import weights_sha256
    from ldlm.training.grid_search import Tuner, TuningInterrupted, TuningSettings, check_reference_steps, schedules_of, tune_grid

    out = _target(args)
    check_reference_steps(args.reference_steps, args.steps, "--reference-steps")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 is fp32 on a GPU too: the reference and the candidates alike
    config = load_config(args.checkpoint)
    too_long = [n for n in (args.tune_length, *args.held_out_lengths) if n > config.max_seq_len]
    if too_long:
        raise ValueError(f"length {too_long[0]} is out of range; allowed: 1..{config.max_seq_len} (the checkpoint's max_seq_len)")
    pipeline = _pipeline(args)
    sha = weights_sha256(Path(args.checkpoint) / WEIGHTS_FILE)
    earlier = _earlier(out, sha, config)
    before = _current(Path(args.checkpoint), sha)
    sampler = args.sampler or config.default_sampler
    settings = TuningSettings(
        sampler, tuple(args.steps), args.reference_steps, args.tune_seed, args.tune_n, args.tune_length,
        args.held_out_seed, args.held_out_n, tuple(args.held_out_lengths), args.evaluations, args.objective, args.validation_seed,
    )  # fmt: skip
    tuner, grids = Tuner(pipeline, settings, progress=not args.quiet), []
    schedules: TunedSchedules | None = earlier
    for steps in settings.steps:
        try:
            grids.append(tune_grid(tuner, steps, progress=not args.quiet))
        except TuningInterrupted as stop:  # keep the best grid found so far, then stop as Ctrl-C does
            grids.append(stop.grid)
            schedules_of(grids, sha, config, earlier).save(out)
            print(f"interrupted: wrote the best grids so far to {out}", file=sys.stderr)
            _report_defaults(args, out, before, schedules_of(grids, sha, config, earlier))
            raise KeyboardInterrupt from None
        schedules = schedules_of(grids, sha, config, earlier)
        schedules.save(out)  # after every step count: an interrupted run keeps the finished ones
        _report(grids[-1], args.json)
    default = schedules.defaults.get(sampler) if schedules is not None else None
    verdict = (
        f"default {sampler} steps: {default} (the fewest that match DDIM@50 held out)"
        if default
        else "no step count matched DDIM@50 held out"
    )
    print(f"wrote {out}; {verdict}", file=sys.stderr)
    if schedules is not None:
        _report_defaults(args, out, before, schedules)


def _target(args: argparse.Namespace) -> Path:
    """Where the grids go, checked before any work: ``--out``, or the checkpoint's own schedules.json, which sets
    the step count every generation from it takes by default, only with ``--force``. An existing file is
    replaced only with ``--force``, and only a schedules file; none is written elsewhere in a checkpoint or
    an ldlm output directory (``ldlm.files.refuse_existing_file``)."""
    from ldlm.files import refuse_existing_file  # per command: building the parser imports no torch
    from ldlm.sampling.tuned_grids import SCHEDULES_FILE, SCHEDULES_WRITER, written_by  # per command, as above

    own = Path(args.checkpoint) / SCHEDULES_FILE
    if args.schedules_out is None and not args.force:
        raise ValueError(
            f"no --out: tune-schedule writes the checkpoint's own {own} (its default step counts) only with --force; "
            "pass --out FILE to write the grids elsewhere, or --force to replace the checkpoint's"
        )
    out = own if args.schedules_out is None else Path(args.schedules_out)
    if out.is_dir() and not out.is_symlink():
        raise ValueError(f"--out {out} is a directory; allowed: a file path, e.g. {out / SCHEDULES_FILE}")
    if not args.force and out.resolve() == own.resolve():
        raise FileExistsError(f"--out {out} is the checkpoint's own schedules.json; pass --force to replace it, or choose another --out")
    refuse_existing_file(out, args.force, SCHEDULES_WRITER, written_by, owned=(SCHEDULES_FILE,))
    return out


def _current(checkpoint: Path, sha: str) -> TunedSchedules | None:
    """The checkpoint's schedules.json as generation uses it now: None when it has none or one for other weights."""
    from ldlm.sampling.tuned_grids import ScheduleError, load_schedules  # per command: building the parser imports no torch

    try:
        return load_schedules(checkpoint, sha256=sha)
    except ScheduleError:
        return None


def _earlier(out: Path, sha: str, config: LDLMConfig) -> TunedSchedules | None:
    """The grids of the file being replaced that this run keeps (other step counts), or None when it has
    none, was tuned for other weights, or at another t_min or prior temperature."""
    from ldlm.sampling.tuned_grids import SCHEDULES_FILE, ScheduleError, load_schedules  # per command: building the parser imports no torch

    if out.name != SCHEDULES_FILE or not out.is_file():
        return None
    try:
        earlier = load_schedules(out.parent, sha256=sha)
    except ScheduleError as error:
        print(f"{error}: its grids are replaced, not kept", file=sys.stderr)
        return None
    if earlier is not None and not earlier.tuned_for(config.t_min, config.effective_prior_temperature):
        print(f"{out}: its grids were tuned at another t_min or prior temperature; they are replaced, not kept", file=sys.stderr)
        return None
    return earlier


def _report_defaults(args: argparse.Namespace, out: Path, before: TunedSchedules | None, after: TunedSchedules) -> None:
    """Which default step counts the written grids change, old -> new per sampler: in the checkpoint when they
    were written into it, else what they would change there."""
    # per command: building the parser imports no torch
    from ldlm.model.checkpoint import load_config
    from ldlm.sampling.tuned_grids import SCHEDULES_FILE
    from ldlm.training.grid_search import default_changes

    changes = default_changes(load_config(args.checkpoint), before, after)
    shown = ", ".join(f"{s} {old} -> {new}" if old != new else f"{s} {old} (unchanged)" for s, (old, new) in changes.items())
    mine = out.resolve() == (Path(args.checkpoint) / SCHEDULES_FILE).resolve()
    where = (
        f"the checkpoint's default steps: {shown}" if mine else f"as {args.checkpoint}'s schedules.json, default steps would be: {shown}"
    )
    print(where, file=sys.stderr)


def _pipeline(args: argparse.Namespace) -> LDLMPipeline:
    """The checkpoint in eager PyTorch, or its export on ONNX Runtime (``--onnx-dir``), without its tuned grids:
    the search names every grid it runs, and a schedules.json tuned for other weights is what it replaces."""
    # per command, not at the top: building the parser (`ldlm --help`) imports no torch
    from ldlm.model.checkpoint import load_checkpoint, load_config
    from ldlm.pipeline import LDLMPipeline
    from ldlm.serve.runtime.backends import BackendGraphs, open_graphs
    from ldlm.serve.runtime.registry import ORT

    if args.onnx_dir is None:
        model, tokenizer = load_checkpoint(args.checkpoint, args.device)
        return LDLMPipeline(model, tokenizer, args.device)
    if args.device != "cpu":
        raise ValueError(f"--device {args.device} applies to eager PyTorch; --onnx-dir tunes on ONNX Runtime on the CPU")

    graphs, config, tokenizer = open_graphs(ORT, args.onnx_dir, threads=args.threads)
    if config.config_hash() != load_config(args.checkpoint).config_hash():
        raise ValueError(f"{args.onnx_dir} was exported from another config than {args.checkpoint}'s; export this checkpoint")
    return LDLMPipeline(BackendGraphs(graphs), tokenizer, config=config)


def _report(grid: TunedGrid, as_json: bool) -> None:
    m = grid.measured
    if as_json:
        print(json.dumps({"sampler": grid.sampler, "steps": grid.steps, "times": grid.times, **m}))
        return
    held = ", ".join(
        f"L{n}: {s['error']:.4f} / {100 * s['tokens']:.1f}% (DDIM@50 {m['ddim50_held_out'][n]['error']:.4f} / "
        f"{100 * m['ddim50_held_out'][n]['tokens']:.1f}%, default grid {m['default_grid_held_out'][n]['error']:.4f})"
        for n, s in m["held_out"].items()
    )
    validation = m["validation"]
    compared = ", ".join(f"{name} {error:.4f}" for name, error in validation["errors"].items())
    print(f"{grid.sampler}@{grid.steps}: held-out error / tokens {held}")
    print(f"  grid ({validation['kept']}, the lowest validation error of {compared}): {', '.join(f'{t:.4f}' for t in grid.times)}")


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune-schedule",
        help="search step grids for a checkpoint (writes its schedules.json)",
        description="For each step count, search the times a sampler steps through so that its output lands where "
        "a fine DDIM reference lands, on seeded tuning samples; score the result on held-out seeds and lengths beside "
        "DDIM@50 and the default grid. Writes schedules.json beside the checkpoint (after every step count, so Ctrl-C "
        "keeps what is done, and the best grid so far of the one interrupted). Generation then uses the tuned grid "
        "where one exists, and the fewest tuned steps that match DDIM@50 as the default step count.",
    )
    p.add_argument("checkpoint", help="checkpoint directory")
    steps_cap = " steps (as ldlm serve's max_steps)"
    p.add_argument(
        "--steps",
        type=capped_positive_int_list(MAX_STEPS, steps_cap),
        default=[6, 8, 10, 12],
        help="step counts to tune (default: 6,8,10,12)",
    )
    p.add_argument("--sampler", choices=SAMPLERS, default=None, help="sampler to tune (default: the checkpoint config's default_sampler)")
    p.add_argument(
        "--reference-steps",
        type=capped_positive_int(100_000, " steps"),
        default=1000,
        help="DDIM steps of the reference; at least 4x the largest step count it scores, DDIM@50 included, so at least 200 (default: 1000)",
    )
    p.add_argument(
        "--evaluations",
        type=int_in(1, MAX_EVALUATIONS),
        default=600,
        help=f"sampling runs per step count, 1..{MAX_EVALUATIONS} (default: 600)",
    )
    _add_sample_options(p)
    p.add_argument("--onnx-dir", default=None, help="tune on this export of the checkpoint, on ONNX Runtime (default: eager PyTorch)")
    p.add_argument(
        "--device",
        default="cpu",
        help="where eager PyTorch tunes: cpu, cuda or cuda:N, in fp32 with TF32 off. The noise is drawn there, so grids "
        "tuned on a GPU differ from the CPU's by the draw; a base model tunes in minutes on one GPU, hours on 2 CPU cores "
        "(default: cpu)",
    )
    p.add_argument("--threads", type=in_range(THREADS, " threads"), default=None, help=f"CPU threads, {THREADS} (default: torch's)")
    _add_output_options(p)
    p.add_argument("--json", action="store_true", help="one JSON line per tuned step count")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_tune_schedule)


def _add_output_options(p: argparse.ArgumentParser) -> None:
    """Where the grids go, and when an existing file there is replaced (ldlm.files.refuse_existing_file)."""
    p.add_argument(
        "--out",
        # not "out": the CLI's checks of an output directory (ldlm.cli.refuse_existing_out) do not fit one file
        dest="schedules_out",
        default=None,
        metavar="FILE",
        help="where to write the grids, e.g. ./schedules.json (a file named schedules.json there keeps the grids of other "
        "step counts). Without --out, the checkpoint's own schedules.json, and only with --force: it sets the default "
        "step count of every generation from the checkpoint. An existing FILE is replaced only with --force and only when "
        "tune-schedule wrote it; no other path inside a checkpoint or an ldlm output directory",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --out file that an earlier tune-schedule wrote (a schedules file), or without --out the checkpoint's "
        "schedules.json; any other file, or one inside a checkpoint or an ldlm output directory, is refused",
    )


def _add_sample_options(p: argparse.ArgumentParser) -> None:
    """The tuning, validation and held-out samples: seeds, counts, lengths, and what the search minimizes."""
    p.add_argument("--tune-seed", type=seed_int, default=101, help="seed of the tuning samples (default: 101)")
    p.add_argument(
        "--tune-n",
        type=capped_positive_int(MAX_N, " samples"),
        default=MAX_N,
        help=f"tuning samples, 1..{MAX_N}; each evaluation runs them all, so fewer on a large model on CPU (default: {MAX_N})",
    )
    p.add_argument(
        "--objective",
        choices=TUNING_OBJECTIVES,
        default=DEFAULT_TUNING_OBJECTIVE,
        help="what the search minimizes over the tuning samples: all samples' pooled relative latent error, or the worst "
        "one's, which keeps out grids that throw the odd sample off (default: %(default)s)",
    )
    p.add_argument("--tune-length", type=capped_positive_int(65536, " tokens"), default=64, help="tokens per tuning sample (default: 64)")
    p.add_argument(
        "--validation-seed",
        type=seed_int,
        default=303,
        help="seed of the validation samples (as many as --tune-n, at --tune-length), on which the default grid, the best "
        "power grid and the searched grid compete; the lowest error is kept (default: 303)",
    )
    p.add_argument("--held-out-seed", type=seed_int, default=202, help="seed of the held-out samples (default: 202)")
    p.add_argument(
        "--held-out-n",
        type=capped_positive_int(MAX_N, " samples"),
        default=32,
        help=f"held-out samples per length, 1..{MAX_N}; too few and one sample decides the verdict (default: 32)",
    )
    p.add_argument(
        "--held-out-lengths",
        type=capped_positive_int_list(65536, " tokens"),
        default=[32, 64, 128],
        help="held-out lengths (default: 32,64,128)",
    )
