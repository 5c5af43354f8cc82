"""``python -m benchmarks.sim hsdp``: several nodes, HSDP vs full sharding, FSDP2 vs ODC, on the same steps.

The mesh is ``R`` replicas x ``S`` shards with ``S`` = GPUs per node (the shard group is one node). Arms:

- **FSDP2 full shard** (`simulator.simulate`, ``"fsdp2"``): one FSDP2 group over all ``R x S`` GPUs, per-layer
  collectives across nodes, every rank in lockstep.
- **FSDP2-HSDP**: per layer an all-gather and a reduce-scatter inside the node, then an all-reduce of the reduced
  shard across the ``R`` replicas (inter-node), every microbatch; the all-reduce couples the replicas, so all ``R x S``
  ranks still move in lockstep, slot by slot.
- **ODC-HSDP** (what `odc_accelerate.engine.hsdp` runs): inside the node ODC as on one node (one-sided reads and
  accumulates, each rank its own microbatches); per optimizer step one all-reduce of each rank's folded gradient
  shard across the replicas, after the node's barrier.
- **ODC full shard** (a prediction for the NVSHMEM route of ``docs/multinode.md``; not built): `simulate` ``"odc"``
  over all ``R x S`` GPUs, one-sided traffic across nodes at the network's bandwidth.

Every arm plans its steps over all ``R x S`` ranks: the FSDP2 arms with the ``lockstep`` plan (and FSDP2-HSDP also
with random sampling, the Trainer's default), the ODC arms with the ``free`` plan.

All-reduce cost (ring, per GPU, each GPU on its own NIC): ``2 (R-1)/R x shard bytes / inter-node bandwidth`` plus
``2 (R-1)`` inter-node latencies. Not modelled, as in `simulator`: the optimizer step, memory limits, stragglers.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks.sim.scale import _draw_lengths, _random_plan, planner_cost
from benchmarks.sim.simulator import (
    H100,
    QWEN2_5_1_5B,
    QWEN2_5_7B,
    Hardware,
    ModelSpec,
    StepResult,
    _pass_time,
    _per_group_compute,
    collective_time,
    one_sided_time,
    plan_arrays,
    simulate,
)
from odc_accelerate.planning import plan_from_costs

# Qwen2.5 configs (the published config.json files), for the memory table.
QWEN2_5_14B = ModelSpec(layers=48, hidden=5120, intermediate=13824, heads=40, kv_heads=8, vocab=152064)
QWEN2_5_32B = ModelSpec(layers=64, hidden=5120, intermediate=27648, heads=40, kv_heads=8, vocab=152064)
QWEN2_5_72B = ModelSpec(layers=80, hidden=8192, intermediate=29568, heads=64, kv_heads=8, vocab=152064)
MODELS = {"1.5b": QWEN2_5_1_5B, "7b": QWEN2_5_7B, "14b": QWEN2_5_14B, "32b": QWEN2_5_32B, "72b": QWEN2_5_72B}
ARMS = (
    "FSDP2 full shard + lockstep",
    "FSDP2-HSDP + random",
    "FSDP2-HSDP + lockstep",
    "ODC full shard + free",
    "ODC-HSDP + free",
)
#: bytes of training state per parameter, sharded: fp32 master weights, fp32 gradients, AdamW's two fp32 moments
STATE_BYTES = 16


def all_reduce_time(nbytes: np.ndarray | float, replicas: int, hw: Hardware) -> np.ndarray | float:
    """Ring all-reduce of ``nbytes`` (per GPU) across ``replicas`` nodes, each GPU on its own network link."""
    if replicas <= 1:
        return np.zeros_like(np.asarray(nbytes, dtype=np.float64)) if np.ndim(nbytes) else 0.0
    out = 2 * (replicas - 1) / replicas * np.asarray(nbytes, dtype=np.float64) / hw.inter_bw
    out = out + 2 * (replicas - 1) * hw.inter_lat
    return out if np.ndim(nbytes) else float(out)


def simulate_hsdp(plan: list, lengths: np.ndarray, model: ModelSpec, hw: Hardware, system: str) -> StepResult:
    """One optimizer step of ``plan`` (over all ``R x S`` ranks, ``S = hw.gpus_per_node``) on an HSDP mesh.

    Args:
        system (`str`): ``"fsdp2"`` (per-layer collectives in the node and a per-microbatch all-reduce across
            replicas, all ranks in lockstep) or ``"odc"`` (ODC in the node, one all-reduce per step).
    """
    if system not in ("fsdp2", "odc"):
        raise ValueError(f"Unknown system {system!r}: use 'fsdp2' or 'odc'.")
    world, shards = len(plan), hw.gpus_per_node
    if world % shards:
        raise ValueError(f"{world} ranks do not form whole nodes of {shards} GPUs.")
    replicas = world // shards
    node = hw.with_(gpus_per_node=shards)
    tok, sq, present = plan_arrays(plan, lengths)
    comp = _per_group_compute(tok, sq, model, hw)  # [G, W, K]
    _, _, params = model.group_costs()
    busy = comp.sum(axis=(0, 2))
    limit = float(busy.mean())
    fwd, bwd = comp / 3.0, comp * (2.0 / 3.0)
    shard_grad_bytes = params * model.grad_bytes / shards
    if system == "fsdp2":
        ag = collective_time(params * model.param_bytes, shards, node)
        rs = collective_time(params * model.grad_bytes, shards, node) + all_reduce_time(shard_grad_bytes, replicas, hw)
        slot_fwd, slot_bwd = fwd.max(axis=1), bwd.max(axis=1)  # lockstep over every rank of every node
        n_slots = tok.shape[1] if present.any() else 0
        per_slot = _pass_time(slot_fwd, ag, hw.overlap) + _pass_time(slot_bwd, ag + rs, hw.overlap)
        step = float(per_slot[:n_slots].sum())
        return StepResult(step, busy, step - busy, float(tok.sum()), limit)
    rd = one_sided_time(params * model.param_bytes, shards, node)
    acc = one_sided_time(params * model.grad_bytes, shards, node)
    per_mb = _pass_time(fwd, rd, hw.overlap) + _pass_time(bwd, rd + acc, hw.overlap)
    per_rank = np.where(present, per_mb, 0.0).sum(axis=1)
    sync = float(all_reduce_time(float(shard_grad_bytes.sum()), replicas, hw))
    step = float(per_rank.max()) + 2 * hw.barrier_lat + sync
    return StepResult(step, busy, step - busy, float(tok.sum()), limit)


def hsdp_memory_gb(model: ModelSpec, shards: int, microbatch_tokens: int) -> dict[str, float]:
    """Rough per-GPU memory (GB) of HSDP with ``shards`` GPUs per shard group, by part.

    ``state``: fp32 weights, gradients and AdamW moments, sharded over the node (`STATE_BYTES` per parameter).
    ``unsharded``: the largest param group gathered in bf16 twice (the current one and the prefetched next) with its
    fp32 unsharded gradient. ``activations``: one microbatch of ``microbatch_tokens`` with activation checkpointing
    (one bf16 hidden state per layer and token, plus one layer's working set, taken as 34 x hidden bytes per token).
    """
    layer = max(model.layer_params, model.root_params)
    parts = {
        "state": STATE_BYTES * model.num_params / shards,
        "unsharded": layer * (2 * model.param_bytes + model.grad_bytes),
        "activations": microbatch_tokens * model.hidden * (2 * model.layers + 34),
    }
    parts = {k: v / 1e9 for k, v in parts.items()}
    parts["total"] = sum(parts.values())
    return parts


def run_hsdp(args: argparse.Namespace) -> dict:
    """Plan the same steps for every arm, simulate them per model and GPU count, print the table."""
    hw = H100.with_(
        flops=args.tflops * 1e12,
        gpus_per_node=args.gpus_per_node,
        intra_bw=args.intra_gbps * 1e9,
        inter_bw=args.inter_gbps * 1e9,
        intra_lat=args.intra_lat_us * 1e-6,
        inter_lat=args.inter_lat_us * 1e-6,
        overlap=not args.no_overlap,
    )
    rng = np.random.default_rng(args.seed)
    print(
        f"Simulated step times, HSDP = nodes x {hw.gpus_per_node} GPUs: {hw.flops / 1e12:.0f} TFLOP/s effective per "
        f"GPU, intra-node {hw.intra_bw / 1e9:.0f} GB/s, inter-node {hw.inter_bw / 1e9:.0f} GB/s per GPU, "
        f"overlap={hw.overlap}; {args.samples_per_rank} samples per rank per step"
    )
    header = (
        f"{'model':6s} {'GPUs':>5s} {'arm':28s} {'step s':>8s} {'Mtok/s':>8s} {'bubble%':>8s} {'vs FSDP2-HSDP':>14s}"
    )
    results: dict = {}
    printed = False
    for name in args.models:
        model = MODELS[name]
        cost = planner_cost(model)
        results[name] = {}
        for world in args.worlds:
            spr = args.samples_per_rank * world
            steps = args.steps or max(2, min(10, 1024 // world))
            lengths, desc, budget = _draw_lengths(args, rng, steps * spr)
            if not printed:
                print(f"lengths: {desc}; microbatch budget {budget} tokens")
                print(header)
                print("-" * len(header))
                printed = True
            t0 = time.perf_counter()
            agg: dict = {arm: [] for arm in ARMS}
            for s in range(steps):
                tok = lengths[s * spr : (s + 1) * spr]
                costs = cost(tok)
                lockstep = plan_from_costs(costs, tok, world, budget, plan="lockstep")
                free = plan_from_costs(costs, tok, world, budget, plan="free")
                agg["FSDP2 full shard + lockstep"].append(simulate(lockstep, tok, model, hw, "fsdp2"))
                agg["FSDP2-HSDP + random"].append(simulate_hsdp(_random_plan(spr, world), tok, model, hw, "fsdp2"))
                agg["FSDP2-HSDP + lockstep"].append(simulate_hsdp(lockstep, tok, model, hw, "fsdp2"))
                agg["ODC full shard + free"].append(simulate(free, tok, model, hw, "odc"))
                agg["ODC-HSDP + free"].append(simulate_hsdp(free, tok, model, hw, "odc"))
            summary = {}
            for arm, res in agg.items():
                step = float(np.mean([r.step_s for r in res]))
                busy = float(np.mean([r.busy_s.mean() for r in res]))
                summary[arm] = {
                    "step_s": step,
                    "tokens_per_s": float(np.sum([r.tokens for r in res])) / (step * len(res)),
                    "bubble_pct": 100 * (1 - busy / step),
                }
            base = summary["FSDP2-HSDP + lockstep"]["tokens_per_s"]
            for arm, a in summary.items():
                a["speedup_vs_fsdp2_hsdp"] = a["tokens_per_s"] / base
                print(
                    f"{name:6s} {world:5d} {arm:28s} {a['step_s']:8.2f} {a['tokens_per_s'] / 1e6:8.3f} "
                    f"{a['bubble_pct']:8.1f} {a['speedup_vs_fsdp2_hsdp']:14.3f}"
                )
            print(f"{'':6s} {'':5s} ({steps} steps, {time.perf_counter() - t0:.1f} s)")
            results[name][world] = summary
    print(
        f"\nMemory per GPU, HSDP with {hw.gpus_per_node} GPUs per shard group, {args.fit_tokens}-token microbatches, "
        f"activation checkpointing (GB):"
    )
    print(f"{'model':6s} {'params':>8s} {'state':>7s} {'gathered':>9s} {'activ.':>7s} {'total':>7s}  verdict")
    for name, model in MODELS.items():
        gb = hsdp_memory_gb(model, hw.gpus_per_node, args.fit_tokens)
        verdict = f"fits {args.gpu_gb:.0f} GB" if gb["total"] <= args.gpu_gb else "needs sharding across nodes"
        print(
            f"{name:6s} {model.num_params / 1e9:7.1f}B {gb['state']:7.1f} {gb['unsharded']:9.1f} "
            f"{gb['activations']:7.1f} {gb['total']:7.1f}  {verdict}"
        )
    return results


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``hsdp`` subcommand's options."""
    p.add_argument("--models", nargs="+", default=["1.5b", "7b"], choices=list(MODELS))
    p.add_argument("--worlds", type=int, nargs="+", default=[16, 64, 256, 1024])
    p.add_argument("--dist", default="longalign", help="longalign | swe-smith | pydoc | bimodal")
    p.add_argument("--lengths-file", default=None, help="token counts, one per line (or .npy); overrides --dist")
    p.add_argument("--samples-per-rank", type=int, default=8, help="samples per rank per optimizer step")
    p.add_argument("--steps", type=int, default=None, help="steps per cell (default: 1024 / GPUs, 2..10)")
    p.add_argument("--tflops", type=float, default=H100.flops / 1e12, help="effective TFLOP/s per GPU")
    p.add_argument("--gpus-per-node", type=int, default=H100.gpus_per_node, help="= the shard group's size")
    p.add_argument("--intra-gbps", type=float, default=H100.intra_bw / 1e9, help="NVLink GB/s per GPU")
    p.add_argument("--inter-gbps", type=float, default=H100.inter_bw / 1e9, help="network GB/s per GPU (400 Gb/s NIC)")
    p.add_argument("--intra-lat-us", type=float, default=H100.intra_lat * 1e6)
    p.add_argument("--inter-lat-us", type=float, default=H100.inter_lat * 1e6)
    p.add_argument("--no-overlap", action="store_true", help="communication does not overlap compute")
    p.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory for the fit table")
    p.add_argument("--fit-tokens", type=int, default=16384, help="microbatch tokens for the fit table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print the results as JSON at the end")
