"""Commands on a checkpoint: make one, sample from it, run texts through its autoencoder."""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

from ldlm.cli.options import STEPS, add_prior_temperature, capped_positive_int, in_range, integer, open_unit_float, seed_int
from ldlm.files import command_writer, force_help
from ldlm.limits import MAX_N, MAX_SEED, MAX_STEPS, PROMPT_STRENGTH, sequence_lengths
from ldlm.model.config import GRIDS, SAMPLERS, TUNED_GRID, LDLMConfig

INIT_WRITER = command_writer("init")  # what an init's output is recorded as written by (ldlm.files.OUTPUT_RECORD)


def _cmd_init(args: argparse.Namespace) -> None:
    # per command, not at the top: building the parser (`ldlm --help`) imports no torch
    from tqdm.auto import tqdm

    from ldlm.files import refuse_existing
    from ldlm.model.checkpoint import init_model, save_checkpoint
    from ldlm.model.config import preset
    from ldlm.model.tokenizer import TextTokenizer

    # before the model is built, which takes a while at base size: only an earlier init's output is replaced
    # by random weights, never a trained, imported or otherwise written checkpoint
    refuse_existing(args.out, args.force, writer=INIT_WRITER)
    config = preset(args.preset)
    with tqdm(total=3, desc="init", unit="stage", disable=args.quiet) as bar:
        bar.set_postfix_str("building the model")
        model = init_model(config, args.seed, args.gpt2_dir, norm_init=args.norm_init)
        bar.update()
        bar.set_postfix_str("loading the tokenizer")
        tokenizer = TextTokenizer.from_directory(args.tokenizer_dir) if args.tokenizer_dir else TextTokenizer.gpt2()
        bar.update()
        bar.set_postfix_str("writing the checkpoint")
        save_checkpoint(model, tokenizer, args.out, overwrite=args.force, writer=INIT_WRITER)
        bar.update()
    weights = "GPT-2 from " + str(args.gpt2_dir) if args.gpt2_dir else "random GPT-2"
    print(f"wrote {args.out} (preset {args.preset}, seed {args.seed}, {weights}, norm init {args.norm_init})")


def _cmd_generate(args: argparse.Namespace) -> None:
    # per command, not at the top: building the parser (`ldlm --help`) imports no torch
    from ldlm.model.checkpoint import load_config
    from ldlm.pipeline import LDLMPipeline

    config = load_config(args.checkpoint)  # the length's range, before the model is built
    lengths = sequence_lengths(config.max_seq_len)
    if args.length not in lengths:
        raise ValueError(lengths.refusal(f"--length {args.length}", " (the checkpoint's max_seq_len)"))
    pipeline = LDLMPipeline.from_checkpoint(args.checkpoint, args.device)
    start = time.perf_counter()
    # what is left out (None) is filled in by ldlm.sampling.resolve, as for a request over HTTP
    result = pipeline.generate(
        args.n,
        args.length,
        args.steps,
        args.seed,
        args.sampler,
        args.t_min,
        not args.quiet,
        args.prompt,
        args.grid,
        args.prior_temperature,
        args.prompt_strength,
    )
    elapsed = time.perf_counter() - start
    if args.json:
        plan = result.plan.summary() if result.plan is not None else None  # what ran, as the HTTP answers name it
        print(json.dumps({"texts": result.texts, "token_ids": result.ids(), "plan": plan, "seconds": elapsed}))
        return
    for i, text in enumerate(result.texts):
        print(f"[{i}] {text!r}")
    ran = f" ({result.plan.sampler.name}, {result.plan.steps} steps, {result.plan.grid} grid)" if result.plan is not None else ""
    print(f"generated {args.n} x {args.length} tokens in {elapsed:.2f} s{ran}", file=sys.stderr)


def _cmd_reconstruct(args: argparse.Namespace) -> None:
    # per command, not at the top: building the parser (`ldlm --help`) imports no torch
    from ldlm.pipeline import LDLMPipeline

    pipeline = LDLMPipeline.from_checkpoint(args.checkpoint, args.device)
    result = pipeline.reconstruct(args.texts)
    if args.json:
        print(json.dumps({"texts": result.texts, "token_ids": result.ids()}))
        return
    for source, text in zip(args.texts, result.texts):
        print(f"{source!r} -> {text!r}")


def _cmd_import_checkpoint(args: argparse.Namespace) -> None:
    # per command, not at the top: building the parser (`ldlm --help`) imports no torch
    from ldlm.importing.config import parse_assignments
    from ldlm.importing.convert import import_checkpoint
    from ldlm.importing.report import ImportCheckpointError
    from ldlm.model.config import preset
    from ldlm.serve.checks.parity import run_parity  # exports and runs ONNX: only when the round runs

    overrides = parse_assignments(args.set or [])
    try:
        report = import_checkpoint(
            args.source,
            args.out,
            args.mapping,
            preset(args.preset),
            overrides,
            args.allow_missing or [],
            args.seed,
            args.tokenizer_dir,
            parity=None if args.skip_parity else functools.partial(run_parity, progress=not args.quiet),
            overwrite=args.force,
        )
    except ImportCheckpointError as error:
        if args.json:  # the whole report on stdout; the error line (every problem) follows on stderr
            print(json.dumps(error.report.to_dict()))
        raise
    if args.json:
        print(json.dumps(report.to_dict()))
        return
    print("\n".join(report.lines()))
    print(f"wrote {args.out}" + (" (parity skipped)" if args.skip_parity else ""))


def add_commands(sub: argparse._SubParsersAction) -> None:
    _add_init(sub)
    _add_generate(sub)
    _add_reconstruct(sub)
    _add_import_checkpoint(sub)


def _add_init(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "init",
        help="write a seeded random-init checkpoint",
        description="Write a checkpoint directory (config.json, model.safetensors, tokenizer.json) with "
        "seeded random weights. GPT-2 weights come from --gpt2-dir when given; nothing is downloaded. "
        "Random weights generate gibberish: this is for testing the tool chain, not for text quality.",
    )
    p.add_argument("out", help="checkpoint directory to create")
    p.add_argument("--preset", choices=["tiny", "base"], default="tiny", help="model size (default: tiny)")
    p.add_argument("--seed", type=seed_int, default=0, help=f"initialization seed, 0..{MAX_SEED} (default: 0)")
    p.add_argument("--gpt2-dir", help="local Hugging Face GPT-2 directory (config.json + model.safetensors)")
    p.add_argument(
        "--norm-init",
        choices=["default", "random"],
        default="default",
        help="random: every LayerNorm/RMSNorm scale and bias and the feature/latent mean and std get "
        "their own seeded values, like a trained checkpoint, so parity sees a norm paired with the wrong "
        "parameters (GPT-2 weights from --gpt2-dir are kept); default: scale 1, bias 0, identity statistics",
    )
    p.add_argument("--tokenizer-dir", help="local tokenizer directory (default: GPT-2 BPE shipped offline)")
    p.add_argument("--force", action="store_true", help=force_help("init"))
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_init, out_example="checkpoint")  # the directory a refused OUT's message suggests


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="sample texts from a checkpoint",
        description="Sample N sequences by denoising latents from noise, then decode them to text.",
    )
    p.add_argument("checkpoint", help="checkpoint directory")
    # the same caps as `ldlm serve` (ldlm.limits): what the server refuses, the CLI refuses too
    p.add_argument(
        "--n",
        type=capped_positive_int(MAX_N, " samples per run (as ldlm serve's max_n)"),
        default=4,
        help=f"number of samples, 1..{MAX_N} (default: 4)",
    )
    # its range is the checkpoint's: checked, both ends named, once the config is read
    p.add_argument("--length", type=integer, default=64, help="tokens per sample, 1..the checkpoint's max_seq_len (default: 64)")
    p.add_argument(
        "--steps",
        type=STEPS,
        default=None,
        help=f"denoising steps, 1..{MAX_STEPS} (default: the sampler's tuned step count where the checkpoint's schedules.json "
        f"has one, else the config's default_steps, {LDLMConfig.default_steps} unless it says otherwise)",
    )
    p.add_argument("--seed", type=seed_int, default=None, help=f"noise seed, 0..{MAX_SEED} (default: 0)")
    p.add_argument(
        "--sampler",
        choices=SAMPLERS,
        default=None,
        help="sde: Euler-Maruyama (stochastic); ddim: deterministic given the seed "
        f"(default: the checkpoint config's default_sampler, {LDLMConfig.default_sampler} unless it says otherwise)",
    )
    p.add_argument(
        "--t-min", type=open_unit_float, default=None, help="last time of the grid, in (0, 1) (default: the config's t_min, 0.05)"
    )
    add_prior_temperature(p)
    p.add_argument(
        "--grid",
        choices=(TUNED_GRID, *GRIDS),
        default=None,
        help="the times the sampler steps through: tuned (the checkpoint's schedules.json, see tune-schedule), or uniform, "
        "power, logsnr (default: tuned where the checkpoint has one for this sampler and step count, else the sampler's own)",
    )
    _add_prompt_options(p)
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text lines")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_generate)


def _add_prompt_options(p: argparse.ArgumentParser) -> None:
    """generate's --prompt and its guidance weight."""
    p.add_argument(
        "--prompt",
        default=None,
        help="text every sample starts with, conditioned by prefix inpainting; fewer tokens than --length, which counts "
        "the prompt too (how well the rest follows depends on the trained model)",
    )
    p.add_argument(
        "--prompt-strength",
        type=in_range(PROMPT_STRENGTH),
        default=None,
        help=f"the prompt's guidance weight w, {PROMPT_STRENGTH}: each step denoises every sample a second time blind to "
        "the prompt and moves its continuation to x0_blind + w (x0_prompted - x0_blind); 0 ignores the prompt, above 1 "
        "pushes away from where the sample would go without it, at twice the denoiser work; without --prompt it "
        "changes nothing (default: 1, inpainting alone: on the reference checkpoint no weight made the corpus's "
        "next words likelier, docs/sampling.md)",
    )


def _add_reconstruct(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "reconstruct",
        help="encode texts to latents and decode them back",
        description="Run texts through the autoencoder (GPT-2 features -> latents -> tokens) and print the result.",
    )
    p.add_argument("checkpoint", help="checkpoint directory")
    p.add_argument("texts", nargs="+", help="texts to reconstruct")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text lines")
    p.set_defaults(func=_cmd_reconstruct)


def _add_import_checkpoint(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import-checkpoint",
        help="convert a trained model's weights into a checkpoint directory",
        description="Convert a safetensors file or a torch.save state dict (read with weights_only=True; pickle is never "
        "run) into a checkpoint directory (config.json, model.safetensors, tokenizer.json). Source keys are renamed by "
        "the mapping's rules (regex -> our parameter name, first match wins); the config starts from --preset, takes what "
        "the tensor shapes show (d_model, layer counts, vocabulary and position sizes) and then --set. Every unmatched "
        "key, missing parameter and shape mismatch is reported, and fails the import. Before OUT is written, one parity "
        "round (ONNX Runtime vs eager) runs on the imported weights.",
    )
    p.add_argument("source", help="a .safetensors file, a torch.save state dict, or a directory holding model.safetensors")
    p.add_argument("out", help="checkpoint directory to create")
    p.add_argument(
        "--mapping",
        default=None,
        help="JSON file of key-mapping rules, or the name of a shipped one: hf-gpt2 (a Hugging Face GPT-2 into the feature "
        "model) or ldlm (ldlm's own parameter names, kept as they are). Default: ldlm when every source key already is "
        "one of ldlm's parameter names (e.g. a checkpoint's model.safetensors), else hf-gpt2",
    )
    p.add_argument("--preset", choices=["tiny", "base"], default="base", help="config the weights' shapes and --set update (default: base)")
    p.add_argument(
        "--set",
        action="append",
        default=None,
        metavar="FIELD=VALUE",
        help="set a config field (repeatable), e.g. --set n_heads=12; wins over the preset and the weights' shapes",
    )
    p.add_argument(
        "--allow-missing",
        action="append",
        default=None,
        metavar="PATTERN",
        help="regex matched at the start of our parameter names (repeatable): parameters it covers that the source lacks keep "
        "the random init of --seed instead of failing the import, e.g. '(?!feature_model\\.)' for all but the feature model",
    )
    p.add_argument(
        "--seed", type=seed_int, default=0, help=f"seed of the random init the --allow-missing parameters keep, 0..{MAX_SEED} (default: 0)"
    )
    p.add_argument("--tokenizer-dir", help="local tokenizer directory (default: GPT-2 BPE shipped offline)")
    p.add_argument(
        "--skip-parity",
        action="store_true",
        help="write OUT without the parity round; it exports the three graphs to ONNX and probes every LayerNorm, "
        "about a minute at tiny size and many at base size (run `ldlm parity OUT` later)",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object (also on failure)")
    p.add_argument("--force", action="store_true", help=force_help("import-checkpoint"))
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_import_checkpoint, out_example="checkpoint")  # the directory a refused OUT's message suggests
