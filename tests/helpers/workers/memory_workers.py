"""Per-rank loops for the step memory policy tests (run through :func:`odc_accelerate.testing.launch`)."""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist

from odc_accelerate.engine import ODCEngine
from odc_accelerate.loss import loss_scale
from odc_accelerate.memory_spec import PeakMemory
from odc_accelerate.testing.models import ToyConfig, build_model, make_steps, shard_model, token_loss_sum
from tests.helpers.infra.dist_counter import count_dist_calls

from .engine_workers import _mp_policy, full_params


def _train_one(rank: int, world_size: int, spec: dict[str, Any], policy: str | None) -> dict[str, Any]:
    """Train the toy LM over ``spec["plan"]`` with ODC under ``policy``, or (``policy`` None) with plain FSDP2 keeping
    its parameters gathered and its gradients unsharded through accumulation (FSDP2's own equivalent of ``both``).

    FSDP2's collectives pair up across ranks, so under plain FSDP2 every rank runs the step's largest microbatch count:
    a rank with fewer pads with zero-weighted microbatches, whose gradient is exactly zero (the sums are unchanged; use
    a model whose every parameter gets a gradient in every backward, as AdamW treats a zero gradient unlike none)."""
    cfg = ToyConfig(**spec.get("cfg", {}))
    model = shard_model(build_model(cfg, seed=0), mp_policy=_mp_policy(spec.get("precision", "fp32")))
    engine = None
    headroom = "30%"
    if policy is not None and "@" in policy:  # "auto@1%": a policy with its headroom
        policy, headroom = policy.split("@")
    if policy is None:
        model.set_reshard_after_forward(False)
        model.set_reshard_after_backward(False)
    else:
        engine = ODCEngine(model, timeout=60.0, memory_policy=policy, memory_headroom=headroom)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out: dict[str, Any] = {"gathers": [], "scatters": [], "counts": [], "choices": [], "peak": []}
    for step in make_steps(spec["plan"], cfg.vocab, seed=1):
        n_global = sum(ids.shape[1] - 1 for rank_mbs in step for ids in rank_mbs)
        scale = loss_scale(n_global, world_size) if n_global else 0.0
        if engine is not None:
            out["choices"].append(engine.memory_choices())
        work = [(ids, scale) for ids in step[rank]]
        if engine is None:
            filler = next(ids for rank_mbs in step for ids in rank_mbs)
            work += [(filler, 0.0)] * (max(len(rank_mbs) for rank_mbs in step) - len(work))
        with count_dist_calls() as calls:
            for i, (ids, weight) in enumerate(work):
                if engine is None:
                    model.set_requires_gradient_sync(i == len(work) - 1)
                loss, _ = token_loss_sum(model, ids)
                (loss * weight).backward()
                if engine is not None and "republish_mid_step" not in out:
                    try:  # a microbatch ran (its gradient may be kept, not added yet): too late to republish
                        engine.republish()
                        out["republish_mid_step"] = "allowed"
                    except RuntimeError as err:
                        out["republish_mid_step"] = str(err)
        out["counts"].append(dict(calls))
        if engine is not None:
            engine.pre_optimizer_step()
            out["unsharded_after_pre"] = sum(
                p.sharded_state.name != "SHARDED" for g in engine._groups for p in g.group.fsdp_params
            )
        else:
            for module in model.modules():
                if hasattr(module, "reshard"):
                    module.reshard()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optim.step()
        optim.zero_grad()
        if engine is not None:
            engine.post_optimizer_step()
            stats = engine.last_step_stats
            out["gathers"].append(stats.gathers)
            out["scatters"].append(stats.scatters)
            out["peak"].append(stats.peak_memory_bytes)
    out["params"] = full_params(model)
    if engine is not None:
        out["groups"] = engine.param_groups
        out["summary"] = engine.memory_summary()
        engine.close()
    return out


def train_policies(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """`_train_one` for each of ``spec["policies"]`` in turn, in one job ("fsdp2-keep": plain FSDP2 keeping both).

    A policy given as a list holds one policy per rank (rank ``r`` runs ``policy[r]``; ODC lets ranks choose
    differently in the same step); its results are keyed by the policies joined with ``"|"``."""
    results = {}
    for policy in spec["policies"]:
        key = "|".join(policy) if isinstance(policy, list) else policy
        mine = policy[rank] if isinstance(policy, list) else policy
        results[key] = _train_one(rank, world_size, spec, None if mine == "fsdp2-keep" else mine)
        dist.barrier()
    return results


def frozen_keep(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """A frozen engine under ``spec["policy"]``: losses and gathers of ``spec["plan"][rank]``'s forwards, then the
    same after `ODCEngine.republish` with weights changed in place on every rank."""
    cfg = ToyConfig()
    model = build_model(cfg, seed=0)
    model.requires_grad_(False)
    model = shard_model(model)
    engine = ODCEngine(model, timeout=60.0, frozen=True, memory_policy=spec["policy"])
    batches = make_steps([spec["plan"]], cfg.vocab, seed=1)[0][rank]
    out: dict[str, Any] = {"groups": len(engine.param_groups)}
    for phase in ("before", "after"):
        with count_dist_calls() as calls, torch.no_grad():
            losses = [float(token_loss_sum(model, ids)[0]) for ids in batches]
        out[phase] = {"losses": losses, "gathers": engine.stats.gathers, "counts": dict(calls)}
        engine.stats.gathers = 0
        if phase == "before":
            dist.barrier()  # the peers' forwards read this rank's shard: change it only once they are done
            engine.reshard()  # the modules hold the gathered copies until then
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.5)  # the local shard: every rank halves its own
            engine.republish()
    engine.close()
    dist.barrier()
    return out


def _rss_now() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)\s+kB", f.read()).group(1)) * 1024


def peak_memory(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """For each of ``spec["policies"]``: the peak memory of every step's microbatches and fold (before the optimizer),
    above the memory in use before its model existed; and the sizes an independent bound is computed from.

    ``spec["device"]``: ``"cpu"`` (default; RSS: run with ``MALLOC_MMAP_THRESHOLD_`` set low, so that freed tensors go
    back to the system and RSS follows the memory in use) or ``"cuda"`` (torch's allocator peak; both ranks on GPU 0,
    the GPU check's layout)."""
    cfg = ToyConfig(**spec["cfg"])
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if spec.get("device") == "cuda":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    # Warm-up on a tiny model through the same code (FSDP2, the engine, AdamW): the interpreter's and torch's one-off
    # costs (imported modules, code pages, thread pools, CUDA kernels) land before the baseline, not in the steps.
    tiny = ToyConfig(vocab=cfg.vocab, dim=32, heads=cfg.heads, layers=1)
    warm = shard_model(build_model(tiny, seed=0).to(device))
    _run_steps(rank, world_size, warm, spec, tiny, "neither", device)
    out: dict[str, Any] = {}
    for policy in spec["policies"]:
        base = _rss_now() if device.type == "cpu" else torch.cuda.memory_allocated(device)
        model = shard_model(build_model(cfg, seed=0).to(device))
        peaks, groups, summary, report = _run_steps(rank, world_size, model, spec, cfg, policy, device)
        del model
        out[policy] = {"peaks": [p - base for p in peaks], "summary": summary, "transport": report}
        out["groups"] = groups
        dist.barrier()
    return out


def neither_bound(groups: list[dict[str, Any]], cfg: dict[str, Any], length: int, world_size: int) -> dict[str, int]:
    """What one rank may hold under ``neither`` (fp32, AdamW), without the transport's pool, from the engine's group
    sizes (`peak_memory`'s ``groups``) and one microbatch of ``length`` tokens of the toy LM ``cfg``.

    * 4 shards: parameters, ``.grad`` and AdamW's two moments are each one shard of the model;
    * FSDP2's working set in a block's backward: the block and the prefetched one gathered, the root (its backward
      spans the blocks'), the block's unsharded gradient, its reduce-scatter input and the previous block's (FSDP2
      keeps one in flight), and the reduce-scatter output;
    * one microbatch's activations, counted independently: the tensors autograd saves for the forward of a plain
      (unsharded) copy of the model.
    """
    shard = sum(g["gather"] for g in groups)
    accumulator = sum(g["reduce"] for g in groups)
    blocks = [g["full"] for g in groups if g["fqn"] != "<root>"]
    root = next(g["full"] for g in groups if g["fqn"] == "<root>")
    model = build_model(ToyConfig(**cfg), seed=0)
    ids = make_steps([[[length]]], cfg["vocab"], seed=1)[0][0][0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_loss_sum(model, ids)
    activations = sum(n for ptr, n in saved.items() if ptr not in params)
    working = 2 * max(blocks) + root + 3 * max(blocks) + max(blocks) // world_size
    return {
        "shard": shard,
        "accumulator": accumulator,
        "working": working,
        "activations": activations,
        "total": 4 * shard + working + activations,
    }


def _run_steps(
    rank: int,
    world_size: int,
    model: Any,
    spec: dict[str, Any],
    cfg: ToyConfig,
    policy: str,
    device: torch.device,
) -> tuple:
    """Train ``model`` over ``spec["plan"]`` under ``policy``: each step's peak memory, the group sizes, the summary
    and the transport's memory report."""
    engine = ODCEngine(model, timeout=60.0, memory_policy=policy)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    peaks = []
    meter = PeakMemory(device)
    for step in make_steps(spec["plan"], cfg.vocab, seed=1):
        n_global = sum(ids.shape[1] - 1 for rank_mbs in step for ids in rank_mbs)
        meter.reset()
        for ids in step[rank]:
            loss, _ = token_loss_sum(model, ids.to(device))
            (loss * loss_scale(n_global, world_size)).backward()
        engine.pre_optimizer_step()
        peaks.append(meter.read())  # the microbatches' and the fold's peak, before the optimizer's own
        optim.step()
        optim.zero_grad(set_to_none=False)  # .grad stays allocated: counted in the bound
        engine.post_optimizer_step()
    groups = [
        {
            "gather": g.gather_numel * g.gather_dtype.itemsize,
            "reduce": g.reduce_numel * g.reduce_dtype.itemsize,
            "full": g.gather_numel * world_size * g.gather_dtype.itemsize,
            "fqn": g.fqn,
        }
        for g in engine._groups
    ]
    summary = engine.memory_summary()
    report = engine.transport.memory_report()
    engine.close()
    return peaks, groups, summary, report
