"""Tables and files of a GRPO benchmark result: text table, README snippet (markdown), ``results.json``, PNG."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.e2e.report import _allocator_text, _fmt_list, markdown_table, text_table
from benchmarks.grpo.aggregate import RATIOS
from benchmarks.grpo.arms import ARMS, RLOO_ARMS, baseline_of
from benchmarks.grpo.plot import plot

PNG = "grpo.png"

_RATIO_NAMES = {
    "step_s": "step time",
    "generation_max_s": "generation time (slowest rank)",
    "tokens_per_s": "tokens/s",
}


def table_rows(result: dict) -> list[list[str]]:
    """Header and one row per arm (in `ARMS` order) of an aggregated result."""
    arms = result["arms"]
    head = ["arm", "step s", "real tok/s", "generation s/rank", "training s/rank", "wait s/rank", "bubble %"]
    head += ["completion len mean/max", "microbatches/rank", "peak RSS MB/rank"]
    rows = [head]
    for name in [n for n in ARMS if n in arms]:
        a = arms[name]
        mb = a["microbatches_min_max"]
        rows.append(
            [
                a["label"],
                f"{a['step_s']:.2f}",
                f"{a['tokens_per_s']:.1f}",
                _fmt_list(a["generation_s"], ".2f"),
                _fmt_list(a["training_s"], ".2f"),
                _fmt_list(a["wait_s"], ".2f"),
                f"{a['bubble_pct']:.1f}",
                f"{a['completion_mean_length']:.1f} / {a['completion_max_length']:.0f}",
                f"{mb[0]}" if mb[0] == mb[1] else f"{mb[0]}-{mb[1]}",
                _fmt_list(a["peak_rss_mb"], ".0f"),
            ]
        )
    return rows


def ratios_text(result: dict) -> list[str]:
    """One line per ratio to an arm's baseline: the median of the per-repeat ratios, and their spread."""
    items = _ratio_items(result)
    width = max((len(text) for text, _, _ in items), default=0) + 2
    return [f"{text:<{width}}{median}{spread}" for text, median, spread in items]


def _ratio_items(result: dict) -> list[tuple[str, str, str]]:
    """``(what, median, spread)`` per arm with a ratio (to its baseline) and per ratio of `RATIOS`."""
    items = []
    for name, ratios in result.get("ratios", {}).items():
        base = ARMS[baseline_of(name)].label
        for key in RATIOS:
            r = ratios[key]
            spread = ""
            if len(r["per_repeat"]) > 1:
                spread = f"  (per repeat {min(r['per_repeat']):.3f}x to {max(r['per_repeat']):.3f}x)"
            items.append((f"{ARMS[name].label} / {base}, {_RATIO_NAMES[key]}", f"{r['median']:.3f}x", spread))
    return items


def conditions_text(result: dict) -> str:
    """One sentence on what ran: sizes, completions per step, repeats, machine load, allocator, date."""
    c = result["config"]
    cond = result["conditions"]
    per_rank = c["per_device_train_batch_size"] * c["gradient_accumulation_steps"]
    return (
        f"{c['world_size']} CPU processes x 1 thread, {_examples_text(result)} (offline tiny Qwen2, pydoc prompts, "
        "each completion "
        f"stopped at its prompt's real continuation length, at most {c['max_completion_length']} tokens), "
        f"{c['completions_per_step']} completions per optimizer step ({per_rank} per rank: "
        f"per_device_train_batch_size {c['per_device_train_batch_size']} x gradient_accumulation_steps "
        f"{c['gradient_accumulation_steps']}; num_generations {c['num_generations']}), {c['max_steps']} steps per run "
        f"of which the first {c['warmup']} dropped, {c['repeats']} interleaved repeats (arm order alternating); 1-min "
        f"load average {cond['load_min']:.1f} to {cond['load_max']:.1f} on {cond['cpus']} cores; "
        f"{_allocator_text(cond)}; {cond['date']}"
    )


def _examples_text(result: dict) -> str:
    """Which examples ran: GRPO's, RLOO's (`benchmarks.grpo.rloo_train`: the offline RLOO script, on the GRPO arms'
    target-length rollout), or both."""
    rloo = RLOO_ARMS & set(result["arms"])
    grpo = set(result["arms"]) - RLOO_ARMS
    rloo_text = "RLOO example on the GRPO example's rollout"
    if rloo and grpo:
        return f"GRPO example and {rloo_text}"
    return rloo_text if rloo else "GRPO example"


NOTES = (
    "Per run: means over the measured steps (every arm draws the same prompts, so the same completion lengths); per "
    "arm: medians over repeats; ratios: per repeat, then their median.",
    "generation = wall time inside `generate`; training = busy - generation (the rank's forward and backward passes, "
    "reference / old-policy forwards included); wait = step - busy (scoring, the step's other collectives, the "
    "optimizer, waiting for the slowest rank). FSDP2's collectives run as in production (not timed): its waits for "
    "peers inside `generate` and inside its microbatches count in generation and training.",
)


def write_outputs(result: dict, out: Path) -> dict[str, Path]:
    """Write ``results.json``, ``table.txt``, ``README_snippet.md`` and (with matplotlib) the PNG into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    rows = table_rows(result)
    ratios = ratios_text(result)
    files = {"json": out / "results.json", "table": out / "table.txt", "snippet": out / "README_snippet.md"}
    files["json"].write_text(json.dumps(result, indent=1))
    files["table"].write_text(
        conditions_text(result) + "\n\n" + text_table(rows) + "\n\n" + "\n".join([*ratios, "", *NOTES]) + "\n"
    )
    png = out / PNG
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
        *[f"- {text}: **{median}**{spread}" for text, median, spread in _ratio_items(result)],
        "",
        *[f"- {note}" for note in NOTES],
    ]
    if plotted:
        snippet += ["", f"![per-rank generation / training / wait and step time]({png.name})"]
    files["snippet"].write_text("\n".join(snippet) + "\n")
    return files
