"""The GPU targets (and the preview cost), read off a gpu_check report: one row per target with the measured figure
and a verdict (met, missed, or not measured and why), and the Markdown summary of a report.
Used by scripts/research/gpu_check.py."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ldlm.serve.runtime.registry import COMPILED, EAGER, INDUCTOR, default_precision

# The precision `ldlm serve --device cuda` runs by default, which the served path's stages time, and the names of
# its torch candidates in a report.
SERVED_PRECISION = default_precision(COMPILED, "cuda")
SERVED = f"{COMPILED}-{SERVED_PRECISION}"
SERVED_EAGER = f"{EAGER}-{SERVED_PRECISION}"
SERVED_INDUCTOR = f"{INDUCTOR}-{SERVED_PRECISION}"

# gpu_check.py's stages, in the order they run (its --stages picks a subset; the summary reports them in this order).
STAGES = (
    "parity",
    "device_loop",
    "latency",
    "long_sample",
    "reference",
    "throughput",
    "batching",
    "fused",
    "attention",
    "http",
    "previews",
    "probe_eps",
)

# (measure, target text, where the figure is in the report, comparison)
Getter = Callable[[dict[str, Any]], Any]


def _stage(report: dict[str, Any], name: str) -> dict[str, Any]:
    stage = report.get("stages", {}).get(name)
    if not isinstance(stage, dict):
        raise LookupError(f"stage {name} did not run")
    for reason in ("skipped", "error"):
        if reason in stage:
            raise LookupError(f"stage {name} {reason}: {str(stage[reason])[:160]}")
    return stage


def _long_sample(r: dict[str, Any]) -> tuple[float, str]:
    s = _stage(r, "long_sample")
    others = "; ".join(
        f"{key.split('/', 1)[1]} {entry['p50_ms']} ms"
        for key, entry in s.items()
        if key.startswith(f"{SERVED}/") and key != f"{SERVED}/ddim"
    )
    also = _inductor_beside(s.get(f"{SERVED_INDUCTOR}/ddim", {}), "p50_ms", "{} ms")
    return s[f"{SERVED}/ddim"]["p50_ms"], f"{s['length']} tokens, {s['steps']} ddim steps, {SERVED}; {others}{also}"


def _inductor_beside(entry: dict[str, Any], field: str, shape: str) -> str:
    """The inductor backend's figure for a note, where it was measured (it is no target's verdict)."""
    return f"; {SERVED_INDUCTOR} {shape.format(entry[field], **entry)}" if field in entry else ""


def _default_sample(r: dict[str, Any]) -> tuple[float, str]:
    s = _stage(r, "long_sample")
    key = next(k for k in s if k.startswith(f"{SERVED}/") and k.endswith("(server default)"))
    inductor: dict[str, Any] = next((v for k, v in s.items() if k.startswith(f"{SERVED_INDUCTOR}/") and k.endswith("(server default)")), {})
    also = _inductor_beside(inductor, "p50_ms", "{} ms")
    return s[key]["p50_ms"], f"{s['length']} tokens, {key.split('/', 1)[1]}, {SERVED}{also}"


def _tokens_per_s(r: dict[str, Any]) -> tuple[float, str]:
    s = _stage(r, "throughput")
    also = _inductor_beside(s.get(INDUCTOR, {}), "tokens_per_s", "{:,.0f} at batch {batch}")
    return s["best"]["tokens_per_s"], f"batch {s['best']['batch']}, length {s['length']}, {s['steps']} steps, {SERVED}{also}"


def _compiled_speedup(r: dict[str, Any]) -> tuple[float, str]:
    graphs = _stage(r, "latency")["graphs"]
    key = next(k for k in graphs if k.startswith("denoiser/b1/"))
    cell = graphs[key]
    return cell[SERVED]["speedup_vs_eager"], f"{key}: eager fp32 {cell[EAGER]['p50_ms']} ms, {SERVED} {cell[SERVED]['p50_ms']} ms"


def _batching(r: dict[str, Any]) -> tuple[tuple[float, float], str]:
    s = _stage(r, "batching")
    return (s["throughput_ratio"], s["p99_ratio"]), (
        f"throughput x{s['throughput_ratio']}, p99 x{s['p99_ratio']} "
        f"({s['requests']} requests at {s['rate_per_s']}/s, max batch {s['max_batch']})"
    )


def _overhead(r: dict[str, Any]) -> tuple[float, str]:
    o = _stage(r, "http")["overhead"]
    return o["overhead_p50_ms"], f"HTTP p50 {o['http_p50_ms']} ms - runner p50 {o['runner_p50_ms']} ms ({o['graph']}, batch 1)"


def _served_agreement(r: dict[str, Any]) -> tuple[float, str]:
    s = _stage(r, "parity")
    names = [n for n in (SERVED_EAGER, SERVED) if n in s]
    if not names:
        raise LookupError(f"no {SERVED_PRECISION} backend in the parity stage")
    worst = min(s[n]["token_agreement"] for n in names)
    cosines = "; ".join(f"{n} cosine min " + ", ".join(f"{o} {v['cosine_min']:.5f}" for o, v in s[n]["outputs"].items()) for n in names)
    return worst, cosines


def _row(stage: dict[str, Any], stage_name: str, name: str) -> dict[str, Any]:
    """One candidate's row of a stage with rows per backend, or a LookupError saying why it has none."""
    row = stage.get(name)
    if not isinstance(row, dict):
        raise LookupError(f"stage {stage_name} has no {name} row")
    for reason in ("skipped", "error"):
        if reason in row:
            raise LookupError(f"{stage_name} {name} {reason}: {str(row[reason])[:160]}" + (f" at {row['where']}" if "where" in row else ""))
    return row


def _fused(r: dict[str, Any]) -> tuple[tuple[bool, float], str]:
    s = _stage(r, "fused")
    row = _row(s, "fused", SERVED_INDUCTOR)
    other = s.get(SERVED, {})
    also = f"; {SERVED} x{other['speedup']}, tokens {'equal' if other['tokens_equal'] else 'DIFFER'}" if "speedup" in other else ""
    return (row["tokens_equal"], row["speedup"]), (
        f"{SERVED_INDUCTOR} (served default), {s['length']} tokens, {s['steps']} {s['sampler']} steps, batch 1: unfused "
        f"{row['unfused_p50_ms']} ms, fused {row['fused_p50_ms']} ms, {row['fused_steps']} steps fused{also}"
    )


def _denoiser_step(r: dict[str, Any]) -> tuple[float, str]:
    s = _stage(r, "attention")
    row = _row(s, "attention", SERVED_INDUCTOR)
    other = s.get(SERVED, {})
    also = f"; {SERVED} {other['no_mask_p50_ms']} ms" if "no_mask_p50_ms" in other else ""
    return row["no_mask_p50_ms"], (
        f"{SERVED_INDUCTOR}, batch {s['batch']} x {s['length']}, no padding (no mask in attention); all-ones mask "
        f"{row['all_ones_mask_p50_ms']} ms, a padded row {row['padded_mask_p50_ms']} ms{also}"
    )


def _preview_cost(r: dict[str, Any]) -> tuple[float, str]:
    s = _stage(r, "previews")
    return s["throughput_cost"], (
        f"previews: {s['preview_events_per_request']} of {s['preview_events_per_request_nominal']} previews per request, "
        f"{s['clients']} clients, length {s['length']}, {s['steps']} steps; first preview at batch 1 "
        f"{s['first_preview_batch1']['median_ms']} ms"
    )


TARGETS: list[tuple[str, str, Callable[[dict[str, Any]], tuple[Any, str]], Callable[[Any], bool], Callable[[Any], str]]] = [
    ("1024-token sample, 50 steps, batch 1, noise to token ids", "<= 100 ms", _long_sample, lambda v: v <= 100, lambda v: f"{v:.1f} ms"),
    (
        "1024-token sample, the server's default sampler and steps, batch 1",
        "<= 40 ms",
        _default_sample,
        lambda v: v <= 40,
        lambda v: f"{v:.1f} ms",
    ),
    ("generated tokens/s at large batch", ">= 20,000", _tokens_per_s, lambda v: v >= 20000, lambda v: f"{v:,.0f}"),
    (
        "compiled backend against eager fp32, one denoiser call at batch 1",
        ">= 3x",
        _compiled_speedup,
        lambda v: v >= 3,
        lambda v: f"x{v:.2f}",
    ),
    (
        "continuous against static batching, mixed arrivals",
        ">= 1.3x throughput, p99 no worse",
        _batching,
        lambda v: v[0] >= 1.3 and v[1] <= 1.0,
        lambda v: f"x{v[0]:.2f}, p99 x{v[1]:.2f}",
    ),
    ("service overhead over the raw runner, p50", "<= 2 ms", _overhead, lambda v: v <= 2, lambda v: f"{v:.3f} ms"),
    (
        f"{SERVED_PRECISION} (served by default) against fp32, deterministic sampler",
        "token agreement >= 99%",
        _served_agreement,
        lambda v: v >= 0.99,
        lambda v: f"{100 * v:.2f}%",
    ),
    (
        "fused steps against unfused, the served default, batch 1",
        "identical tokens, >= 1.3x",
        _fused,
        lambda v: v[0] and v[1] >= 1.3,
        lambda v: f"tokens {'identical' if v[0] else 'DIFFER'}, x{v[1]:.2f}",
    ),
    (
        "denoiser call, batch 1 x 1024 tokens, no padding, the served default",
        "<= 0.9 ms",
        _denoiser_step,
        lambda v: v <= 0.9,
        lambda v: f"{v:.3f} ms",
    ),
    (
        "streamed previews every 5 steps, never skipped: throughput cost",
        "<= 10%",
        _preview_cost,
        lambda v: v <= 0.10,
        lambda v: f"{100 * v:.1f}%",
    ),
]


def target_rows(report: dict[str, Any]) -> list[dict[str, str]]:
    rows = []
    for measure, target, get, ok, show in TARGETS:
        try:
            value, note = get(report)
            rows.append(
                {"measure": measure, "target": target, "measured": show(value), "verdict": "met" if ok(value) else "MISSED", "note": note}
            )
        except (LookupError, KeyError, StopIteration, TypeError) as error:
            rows.append(
                {
                    "measure": measure,
                    "target": target,
                    "measured": "-",
                    "verdict": "not measured",
                    "note": str(error) or type(error).__name__,
                }
            )
    return rows


def targets_markdown(rows: list[dict[str, str]]) -> str:
    lines = ["| measure | target | measured | verdict | how |", "|---|---|---|---|---|"]
    lines += [f"| {r['measure']} | {r['target']} | {r['measured']} | {r['verdict']} | {r['note']} |" for r in rows]
    return "\n".join(lines)


def summary_markdown(report: dict[str, Any]) -> str:
    env = report.get("environment", {})
    stages = report.get("stages", {})
    lines = [
        f"# GPU check, {report.get('date', '?')}",
        "",
        f"{env.get('gpu', 'no GPU')} (compute capability {env.get('capability', '-')}), torch {env.get('torch')}, "
        f"config **{report.get('config')}** on **{report.get('device')}**; {report.get('elapsed_s', '?')} s in all.",
        "",
    ]
    if report.get("tiny"):
        lines += ["> Dry run with the tiny config: the figures below exercise the script, they are not comparable with the targets.", ""]
    lines += ["## Targets", "", targets_markdown(target_rows(report)), ""]
    lines += ["## Stages", "", "| stage | what happened |", "|---|---|"] + [f"| {n} | {s} |" for n, s in stage_statuses(stages)] + [""]
    parity = stages.get("parity", {})
    candidates = [k for k, v in parity.items() if isinstance(v, dict) and "outputs" in v]
    if candidates:
        lines += [
            "## Parity against CPU fp32 eager (worst over random, padded and stress inputs)",
            "",
            "| backend | output | max abs error | cosine min | elementwise at atol/rtol |",
            "|---|---|---|---|---|",
        ]
        for name in candidates:
            for output, v in parity[name]["outputs"].items():
                lines.append(
                    f"| {name} | {output} | {v['max_abs']:.3g} | {v['cosine_min']:.6f} | {'pass' if v['elementwise_passed'] else 'fail'} "
                    f"({parity[name]['atol']:g}/{parity[name]['rtol']:g}) |"
                )
        lines += ["", "| backend | end-to-end token agreement (ddim) | decoder token agreement |", "|---|---|---|"]
        for name in candidates:
            dec = ", ".join(f"{k} {100 * v:.2f}%" for k, v in parity[name]["decoder_token_agreement"].items())
            lines.append(f"| {name} | {100 * parity[name]['token_agreement']:.2f}% | {dec} |")
        lines.append("")
    lines += _latency_markdown(stages.get("latency", {}).get("graphs", {}))
    for name in (*(s for s in STAGES if s not in ("parity", "latency")), "ort_gpu"):  # those two have tables above
        if name in stages:
            lines += [f"## {name}", "", "```", json.dumps(_brief(stages[name]), indent=1, default=str)[:4000], "```", ""]
    errors = {k: v["error"] for k, v in stages.items() if isinstance(v, dict) and "error" in v}
    if errors:
        lines += ["## Stage errors", ""] + [f"- {k}: {v}" for k, v in errors.items()] + [""]
    return "\n".join(lines)


def _status(result: dict[str, Any]) -> str | None:
    """'skipped: why' or 'FAILED at where: error' for a stage or a row of one; None where it ran."""
    if "skipped" in result:
        return f"skipped: {str(result['skipped'])[:200]}"
    if "error" in result:
        return f"FAILED at {result.get('where', '?')}: {str(result['error'])[:200]}"
    return None


def stage_statuses(stages: dict[str, Any]) -> list[tuple[str, str]]:
    """Whether each stage ran (and in how long), was skipped (why) or failed (where); then each of its rows per
    backend that was skipped or failed on its own (the fused and attention stages' candidates, say)."""
    rows: list[tuple[str, str]] = []
    for name, result in stages.items():
        if not isinstance(result, dict):
            continue
        status = _status(result)
        if status is None and result and all(isinstance(v, str) for v in result.values()):  # notes, not figures (ort_gpu's)
            status = "; ".join(f"{k}: {v}" for k, v in result.items())[:300]
        rows.append((name, status or (f"ran in {result['stage_s']} s" if "stage_s" in result else "ran")))
        rows += [(f"{name} / {k}", status) for k, v in result.items() if isinstance(v, dict) and (status := _status(v)) is not None]
    return [(n, s.replace("|", "/").replace("\n", " ")) for n, s in rows]


def _brief(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _brief(v) for k, v in value.items() if k not in ("traceback", "comparisons")}
    return value


def _latency_markdown(latency: dict[str, Any]) -> list[str]:
    """The latency table: p50 ms per graph and backend, with the speed-up against eager fp32."""
    if not latency:
        return []
    lines: list[str] = []
    backends = sorted({b for cell in latency.values() for b in cell})
    lines += [
        "## Latency per graph, p50 ms (speed-up against eager fp32)",
        "",
        "| graph | " + " | ".join(backends) + " |",
        "|---|" + "---|" * len(backends),
    ]
    for key, cell in latency.items():
        lines.append(
            f"| {key} | "
            + " | ".join(
                f"{cell[b]['p50_ms']:.3f}" + (f" (x{cell[b]['speedup_vs_eager']:.2f})" if "speedup_vs_eager" in cell[b] else "")
                if b in cell
                else "-"
                for b in backends
            )
            + " |"
        )
    lines.append("")
    return lines
