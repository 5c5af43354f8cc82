"""Command line of the transport benchmark: runs the workers, prints the table and JSON, stores the results."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.transport import RESULTS_DIR
from benchmarks.transport.workers import rank_main

COLUMNS = [
    ("read_1MiB_MBps", "read 1MiB MB/s", "{:.0f}"),
    ("read_16MiB_MBps", "read 16MiB MB/s", "{:.0f}"),
    ("acc_1MiB_MBps", "acc 1MiB MB/s", "{:.0f}"),
    ("acc_16MiB_MBps", "acc 16MiB MB/s", "{:.0f}"),
    ("read_latency_us", "read 64B us", "{:.1f}"),
    ("acc_latency_us", "acc 64B us", "{:.1f}"),
    ("barrier_latency_us", "barrier us", "{:.1f}"),
]


def format_table(results: dict[str, dict[str, float]]) -> str:
    header = ["transport"] + [title for _, title, _ in COLUMNS]
    rows = [[name] + [fmt.format(res[key]) for key, _, fmt in COLUMNS] for name, res in results.items()]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(header, widths, strict=True)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from odc_accelerate.testing import launch

    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.transport", description="Read / accumulate bandwidth and latency per transport."
    )
    parser.add_argument("--repeats", type=int, default=9, help="interleaved repeats (median reported)")
    parser.add_argument("--iters", type=int, default=32, help="1 MiB operations per bandwidth sample")
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS_DIR,
        help="folder for results.json and table.txt (default: the stored results)",
    )
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = launch(rank_main, 2, args.repeats, args.iters, timeout=600)[0]
    title = (
        f"ODC transports, 2 CPU processes on one machine, medians of {args.repeats} interleaved repeats\n"
        "(hierarchical: the two ranks claim distinct hosts, so this is its cross-host TCP path)"
    )
    table = format_table(results)
    summary = {"benchmark": "transport", "repeats": args.repeats, "results": results}
    print(title)
    print(table)
    print(f"wall time {time.perf_counter() - start:.1f}s")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    (args.out / "table.txt").write_text(title + "\n" + table + "\n")
    print(f"wrote {args.out / 'results.json'}, {args.out / 'table.txt'}")
    print(json.dumps(summary))
    return 0
