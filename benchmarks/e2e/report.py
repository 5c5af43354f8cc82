"""Tables and files of an end-to-end result: text table, README snippet (markdown), ``results.json``, PNG."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.e2e.arms import ARMS, BASELINES
from benchmarks.e2e.plot import plot


def _fmt_list(values: list[float], fmt: str) -> str:
    return " ".join(format(v, fmt) for v in values)


def table_rows(result: dict) -> list[list[str]]:
    """Header and one row per arm (in `ARMS` order) of an aggregated result."""
    arms = result["arms"]
    padding = any(a.get("padding_pct") is not None for a in arms.values())
    head = ["arm", "step s", "real tok/s", "bubble %", *(["padding %"] if padding else [])]
    head += ["busy s/rank", "wait s/rank", "peak RSS MB/rank"]
    head += [f"vs {ARMS[b].label.split(' + ')[1]}" for b in BASELINES if b in arms]
    head += ["of limit"] if "limit" in arms else []
    ideal = "ideal" in result
    head += ["step / ideal"] if ideal else []
    rows = [head]
    for name in [n for n in ARMS if n in arms]:
        a = arms[name]
        limit = name == "limit"
        row = [
            a["label"],
            f"{a['step_s']:.2f}",
            f"{a['tokens_per_s']:.1f}",
            f"{a['bubble_pct']:.1f}",
            *([_padding_cell(a.get("padding_pct"))] if padding else []),
            _fmt_list(a["busy_s"], ".2f"),
            _fmt_list(a["wait_s"], ".2f"),
            _fmt_list(a["peak_rss_mb"], ".0f") + (" (1 proc, unsharded)" if limit else ""),
        ]
        row += [f"{a[f'speedup_vs_{b}']:.2f}x" for b in BASELINES if b in arms]
        row += [f"{a['of_limit']:.2f}"] if "limit" in arms else []
        row += ["" if limit else f"{a['step_over_ideal']:.2f}"] if ideal else []
        rows.append(row)
    return rows


def _padding_cell(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def text_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(lines)


def targets_text(result: dict) -> list[str]:
    """One line per target (value, target, met or not, the per-repeat spread), plus notes on what was not measured."""
    names = {
        "odc_vs_fsdp2_random": "ODC tokens/s over FSDP2 + random",
        "odc_vs_fsdp2_rebalance": "ODC tokens/s over FSDP2 + batch_rebalance",
        "odc_bubble_pct": "ODC bubble %",
        "dynamic_vs_fsdp2_random": "ODC + dynamic tokens/s over FSDP2 + random",
        "dynamic_bubble_pct": "ODC + dynamic bubble %",
        "dynamic_vs_free_equal": "ODC + dynamic tokens/s over ODC + free",
        "dynamic_step_over_ideal": "ODC + dynamic step time over the ideal",
        "dynamic_vs_free_slowed": "ODC + dynamic tokens/s over ODC + free",
        "ordered_step_over_atomic": "ODC ordered step time over ODC atomic",
    }
    # the same targets for the pair that keeps parameters and gradients through the step (odc_memory_policy both)
    names.update(
        {
            k + "_keep_both": v.replace("ODC + dynamic", "ODC + dynamic, keep both").replace(
                "ODC + free", "ODC + free, keep both"
            )
            for k, v in list(names.items())
            if k.startswith("dynamic")
        }
    )
    lines = []
    targets = {**result.get("targets", {}), **result.get("dynamic_targets", {}), **result.get("ordered_targets", {})}
    for key, t in targets.items():
        # three decimals for ratios: at two, 1.295 prints as 1.30x next to "NOT met" for a 1.3 target
        value = f"{t['value']:.3f}x" if "vs" in key or "over" in key else f"{t['value']:.2f}"
        spread = ""
        if len(t.get("per_repeat") or []) > 1:
            spread = f"; per repeat {min(t['per_repeat']):.3f}x to {max(t['per_repeat']):.3f}x"
        lines.append(f"{names[key]:<56}{value:>8}  (target {t['target']}: {'met' if t['met'] else 'NOT met'}{spread})")
    if result.get("limit_from_odc_busy_tokens_per_s"):
        lines.append(
            f"{'limit estimated from ODC mean busy time':<56}{result['limit_from_odc_busy_tokens_per_s']:>8.1f}  "
            "tok/s (busy includes ODC's own copies and adds: a lower bound on the limit's tokens/s)"
        )
    if "ideal" in result:
        speeds = " ".join(f"{v:.2f}" for v in result["ideal"]["speeds"])
        lines.append(
            f"step / ideal: each arm's step time over its ideal for rank speeds {speeds}: its own busy time in "
            "full-speed seconds (sum over ranks of busy x speed) over the sum of the ranks' speeds"
        )
    return lines


_SAMPLE_NAMES = {"dpo": "pairs", "kto": "examples"}
"""What a workload's samples per step are called (default: samples)."""


def conditions_text(result: dict) -> str:
    """One sentence on what ran: sizes, samples per step, repeats, machine load, allocator, date."""
    c = result["config"]
    cond = result["conditions"]
    return (
        f"{c['world_size']} CPU processes x 1 thread, {c['workload']} example (offline tiny Qwen2, pydoc text), "
        f"max_length {c['max_length']}, {c['samples_per_step']} {_SAMPLE_NAMES.get(c['workload'], 'samples')} "
        "per optimizer step "
        f"(FSDP2 arms: {c['per_device_train_batch_size']} per microbatch x {c['gradient_accumulation_steps']} "
        f"accumulation x {c['world_size']} ranks), {c['max_steps']} steps per run of which the first "
        f"{c['warmup']} dropped, {c['repeats']} interleaved repeats; 1-min load average {cond['load_min']:.1f} to "
        f"{cond['load_max']:.1f} on {cond['cpus']} cores; "
        f"{_allocator_text(cond)}; {cond['date']}" + _slow_text(c.get("slow"))
    )


def _slow_text(slow: dict | None) -> str:
    if not slow:
        return ""
    return (
        f"; rank {slow['rank']} slowed {slow['factor']:g}x in every arm but the limit (after each microbatch it sleeps "
        f"{slow['factor'] - 1:g}x the microbatch's measured compute)"
    )


def _allocator_text(cond: dict) -> str:
    if "allocator" not in cond:  # runs recorded before the option existed used glibc's defaults
        return "system allocator"
    if cond["allocator"] == "caching" and not cond.get("allocator_env"):
        return "system allocator (caching asked, not glibc)"
    return f"{cond['allocator']} allocator"


def write_outputs(result: dict, out: Path) -> dict[str, Path]:
    """Write ``results.json``, ``table.txt``, ``README_snippet.md`` and (with matplotlib) the PNG into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    rows = table_rows(result)
    table = text_table(rows)
    targets = targets_text(result)
    files = {"json": out / "results.json", "table": out / "table.txt", "snippet": out / "README_snippet.md"}
    files["json"].write_text(json.dumps(result, indent=1))
    files["table"].write_text(conditions_text(result) + "\n\n" + table + "\n\n" + "\n".join(targets) + "\n")
    png = out / f"e2e_{result['config']['workload']}.png"
    plotted = plot(result, png, title=conditions_text(result))
    if plotted:
        files["png"] = png
    snippet = [
        "```bash",
        result["config"]["command"],
        "```",
        "",
        conditions_text(result) + ".",
        "",
        markdown_table(rows),
        "",
        *[f"- {line}" for line in targets],
    ]
    if plotted:
        snippet += ["", f"![per-rank busy/wait and tokens/s]({png.name})"]
    files["snippet"].write_text("\n".join(snippet) + "\n")
    return files
