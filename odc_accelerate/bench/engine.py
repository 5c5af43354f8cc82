"""``python -m odc_accelerate.bench engine``: ODC vs FSDP2 step time and memory on 2 CPU ranks.

Arms (one thread per rank; all four live in the same pair of processes and run interleaved step by
step, rotating the order, so that machine noise hits every arm alike):

* ``fsdp``: FSDP2 with its gloo all-gather / reduce-scatter;
* ``odc``: the same model through :class:`~odc_accelerate.ODCEngine` (shared-memory transport);
* ``odc_layersync``: ODC with a barrier inside every hook: same data path, FSDP2's per-layer sync;
* ``limit``: each rank trains an unsharded local copy with no communication at all (the physical
  limit of a step is the mean per-rank compute).

Workloads, same sequences per rank and step in both, so per-rank totals are identical:

* balanced: both ranks run ``[long, short]`` (every microbatch slot matched);
* imbalanced: rank 0 runs ``[long, short]``, rank 1 ``[short, long]`` (4:1 per slot at the default).

Step time = first microbatch to end of the optimizer step, between two barriers; medians over the
measured steps (warm-up steps dropped). Peak memory comes from separate process pairs that run one
arm each (peak RSS cannot be split between arms of one process): max over ranks of the process peak
RSS, where shared-memory pages a rank maps count in its RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time
from typing import Any

ARMS = ("fsdp", "odc", "odc_layersync", "limit")
WORKLOADS = ("balanced", "imbalanced")


def _rank_plan(workload: str, rank: int, long: int, short: int) -> list[int]:
    if workload == "balanced" or rank == 0:
        return [long, short]
    return [short, long]


class _Arm:
    """One arm's model, optimizer and engine inside a worker process."""

    def __init__(self, arm: str, cfg: dict[str, Any]) -> None:
        import torch

        from ..engine import ODCEngine
        from ..testing.models import ToyConfig, build_model, shard_model

        self.model = build_model(ToyConfig(**cfg), seed=0)
        self.engine = None
        if arm != "limit":
            self.model = shard_model(self.model)
            if arm.startswith("odc"):
                self.engine = ODCEngine(self.model, sync_every_hook=arm == "odc_layersync", timeout=600)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)

    def step(self, batches: list, n_global: int, world_size: int) -> tuple[float, float]:
        """One optimizer step between two barriers; returns (seconds, seconds blocked in ODC barriers)."""
        import torch.distributed as dist

        from ..loss import loss_scale
        from ..testing.models import token_loss_sum

        dist.barrier()
        start = time.perf_counter()
        for ids in batches:
            loss, _ = token_loss_sum(self.model, ids)
            (loss * loss_scale(n_global, world_size)).backward()
        if self.engine is not None:
            self.engine.pre_optimizer_step()
        self.optim.step()
        self.optim.zero_grad()
        if self.engine is not None:
            self.engine.post_optimizer_step()
        elapsed = time.perf_counter() - start
        dist.barrier()
        wait = self.engine.last_step_stats.wait_s if self.engine is not None else 0.0
        return elapsed, wait

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()


def _batches(workload: str, rank: int, opts: dict[str, Any], vocab: int, gen) -> tuple[list, int]:
    import torch

    lengths = _rank_plan(workload, rank, opts["long"], opts["short"])
    batches = [torch.randint(0, vocab, (1, n + 1), generator=gen) for n in lengths]
    return batches, 2 * sum(lengths)  # both ranks hold the same lengths in total


def _timing_worker(rank: int, world_size: int, cfg: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """Every arm in the same process pair, interleaved step by step, so machine noise hits all arms alike."""
    import torch

    arms = {arm: _Arm(arm, cfg) for arm in ARMS}
    gen = torch.Generator().manual_seed(1234 + rank)
    times = {a: {w: [] for w in WORKLOADS} for a in ARMS}
    waits = {a: {w: [] for w in WORKLOADS} for a in ARMS}
    for step in range(opts["warmup"] + opts["steps"]):
        order = ARMS[step % len(ARMS) :] + ARMS[: step % len(ARMS)]  # rotate: no arm always runs first
        for arm in order:
            for workload in WORKLOADS if step % 2 else WORKLOADS[::-1]:
                batches, n_global = _batches(workload, rank, opts, cfg["vocab"], gen)
                elapsed, wait = arms[arm].step(batches, n_global, world_size)
                if step >= opts["warmup"]:
                    times[arm][workload].append(elapsed)
                    waits[arm][workload].append(wait)
    for a in arms.values():
        a.close()
    return {"times": times, "waits": waits}


def _memory_worker(rank: int, world_size: int, arm: str, cfg: dict[str, Any], opts: dict[str, Any]) -> float:
    """Peak RSS (MB) of a process that runs only ``arm`` (peak RSS cannot be split between arms of one process)."""
    import torch

    model = _Arm(arm, cfg)
    gen = torch.Generator().manual_seed(1234 + rank)
    for _ in range(2):
        for workload in WORKLOADS:
            model.step(*_batches(workload, rank, opts, cfg["vocab"], gen), world_size)
    model.close()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m odc_accelerate.bench engine", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8, help="measured steps per arm and workload")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--long", type=int, default=1024, help="tokens of the long sequence")
    p.add_argument("--short", type=int, default=256, help="tokens of the short sequence (4:1 by default)")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (for tests)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.layers, args.dim, args.long, args.short = 2, 1, 2, 64, 64, 16
        args.vocab = 256
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    from ..testing import launch

    cfg = dict(vocab=args.vocab, dim=args.dim, heads=args.heads, layers=args.layers, mlp_ratio=4)
    opts = dict(warmup=args.warmup, steps=args.steps, long=args.long, short=args.short)
    results = launch(_timing_worker, 2, cfg, opts, timeout=3600, threads=1)
    # Each step ends with a barrier, so both ranks time the same step; take the slower rank's view.
    samples = {
        a: {
            w: [max(t) for t in zip(results[0]["times"][a][w], results[1]["times"][a][w], strict=True)]
            for w in WORKLOADS
        }
        for a in ARMS
    }
    rss = {a: max(launch(_memory_worker, 2, a, cfg, opts, timeout=1800, threads=1)) for a in ("fsdp", "odc")}
    med = {a: {w: statistics.median(samples[a][w]) * 1e3 for w in WORKLOADS} for a in ARMS}
    odc_waits = [x for r in results for x in r["waits"]["odc"]["imbalanced"]]
    summary = {
        "fsdp_balanced_ms": med["fsdp"]["balanced"],
        "fsdp_imbalanced_ms": med["fsdp"]["imbalanced"],
        "odc_balanced_ms": med["odc"]["balanced"],
        "odc_imbalanced_ms": med["odc"]["imbalanced"],
        "odc_layersync_balanced_ms": med["odc_layersync"]["balanced"],
        "odc_layersync_imbalanced_ms": med["odc_layersync"]["imbalanced"],
        "limit_balanced_ms": med["limit"]["balanced"],
        "limit_imbalanced_ms": med["limit"]["imbalanced"],
        "fsdp_peak_rss_mb": rss["fsdp"],
        "odc_peak_rss_mb": rss["odc"],
        "odc_wait_imbalanced_ms": statistics.median(odc_waits) * 1e3,
    }
    summary["ratio_odc_imbalanced_over_balanced"] = summary["odc_imbalanced_ms"] / summary["odc_balanced_ms"]
    summary["ratio_fsdp_over_odc_imbalanced"] = summary["fsdp_imbalanced_ms"] / summary["odc_imbalanced_ms"]
    summary["ratio_odc_over_fsdp_balanced"] = summary["odc_balanced_ms"] / summary["fsdp_balanced_ms"]
    summary["ratio_odc_over_fsdp_rss"] = summary["odc_peak_rss_mb"] / summary["fsdp_peak_rss_mb"]
    summary["config"] = dict(cfg, **opts, samples_per_cell=len(samples["odc"]["balanced"]))
    return summary


def _table(s: dict[str, Any]) -> str:
    rows = [
        ("arm", "balanced ms", "imbalanced ms", "imb/bal", "peak RSS MB"),
        ("FSDP2 (gloo)", s["fsdp_balanced_ms"], s["fsdp_imbalanced_ms"], None, s["fsdp_peak_rss_mb"]),
        ("ODC", s["odc_balanced_ms"], s["odc_imbalanced_ms"], None, s["odc_peak_rss_mb"]),
        ("ODC + per-layer barrier", s["odc_layersync_balanced_ms"], s["odc_layersync_imbalanced_ms"], None, None),
        ("limit (no comm)", s["limit_balanced_ms"], s["limit_imbalanced_ms"], None, None),
    ]
    lines = []
    for i, (name, bal, imb, _, mem) in enumerate(rows):
        if i == 0:
            lines.append(f"{name:<26}{bal:>13}{imb:>15}{'imb/bal':>9}{mem:>13}")
            continue
        mem_text = f"{mem:13.0f}" if mem is not None else f"{'-':>13}"
        lines.append(f"{name:<26}{bal:13.1f}{imb:15.1f}{imb / bal:9.2f}{mem_text}")
    lines += [
        "",
        f"ODC imbalanced / ODC balanced        {s['ratio_odc_imbalanced_over_balanced']:.3f}  (target <= 1.05)",
        f"FSDP2 imbalanced / ODC imbalanced    {s['ratio_fsdp_over_odc_imbalanced']:.3f}  (target >= 1.8)",
        f"ODC balanced / FSDP2 balanced        {s['ratio_odc_over_fsdp_balanced']:.3f}  (target <= 0.85)",
        f"ODC peak RSS / FSDP2 peak RSS        {s['ratio_odc_over_fsdp_rss']:.3f}  (target <= 1.15)",
        f"ODC barrier wait per imbalanced step {s['odc_wait_imbalanced_ms']:.1f} ms",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv or [])
    summary = run(args)
    c = summary["config"]
    print(
        f"ODC engine benchmark: 2 CPU ranks x 1 thread, {c['layers']} blocks, dim {c['dim']}, "
        f"microbatches long={c['long']} short={c['short']} tokens, arms interleaved step by step, "
        f"{c['samples_per_cell']} measured steps per cell (medians)"
    )
    print(_table(summary))
    print(json.dumps(summary))
    return 0
