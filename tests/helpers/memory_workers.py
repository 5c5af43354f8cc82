"""Per-rank loops for the step memory policy tests (run through :func:`odc_accelerate.testing.launch`)."""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist

from odc_accelerate.engine import ODCEngine
from odc_accelerate.loss import loss_scale
from odc_accelerate.testing.models import ToyConfig, build_model, make_steps, shard_model, token_loss_sum

from .dist_counter import count_dist_calls
from .engine_workers import _mp_policy, full_params


def _train_one(rank: int, world_size: int, spec: dict[str, Any], policy: str | None) -> dict[str, Any]:
    """Train the toy LM over ``spec["plan"]`` with ODC under ``policy``, or (``policy`` None) with plain FSDP2 keeping
    its parameters gathered and its gradients unsharded through accumulation (FSDP2's own equivalent of ``both``;
    equal microbatch counts only)."""
    cfg = ToyConfig(**spec.get("cfg", {}))
    model = shard_model(build_model(cfg, seed=0), mp_policy=_mp_policy(spec.get("precision", "fp32")))
    engine = None
    if policy is None:
        model.set_reshard_after_forward(False)
        model.set_reshard_after_backward(False)
    else:
        engine = ODCEngine(model, timeout=60.0, memory_policy=policy, memory_headroom=spec.get("headroom", "30%"))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    out: dict[str, Any] = {"gathers": [], "scatters": [], "counts": [], "choices": [], "peak": []}
    for step in make_steps(spec["plan"], cfg.vocab, seed=1):
        n_global = sum(ids.shape[1] - 1 for rank_mbs in step for ids in rank_mbs)
        scale = loss_scale(n_global, world_size) if n_global else 0.0
        if engine is not None:
            out["choices"].append(engine.memory_choices())
        with count_dist_calls() as calls:
            for i, ids in enumerate(step[rank]):
                if engine is None:
                    model.set_requires_gradient_sync(i == len(step[rank]) - 1)
                loss, _ = token_loss_sum(model, ids)
                (loss * scale).backward()
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
    """`_train_one` for each of ``spec["policies"]`` in turn, in one job ("fsdp2-keep": plain FSDP2 keeping both)."""
    results = {}
    for policy in spec["policies"]:
        results[policy] = _train_one(rank, world_size, spec, None if policy == "fsdp2-keep" else policy)
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
    """Peak RSS of one optimizer step under ``spec["policy"]``, above the RSS before the model existed, and the
    sizes an independent bound is computed from."""
    cfg = ToyConfig(**spec["cfg"])
    torch.set_num_threads(1)
    base = _rss_now()
    model = shard_model(build_model(cfg, seed=0))
    engine = ODCEngine(model, timeout=60.0, memory_policy=spec["policy"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = make_steps(spec["plan"], cfg.vocab, seed=1)
    peaks = []
    for step in steps:
        n_global = sum(ids.shape[1] - 1 for rank_mbs in step for ids in rank_mbs)
        for ids in step[rank]:
            loss, _ = token_loss_sum(model, ids)
            (loss * loss_scale(n_global, world_size)).backward()
        engine.pre_optimizer_step()
        optim.step()
        optim.zero_grad(set_to_none=False)  # .grad stays allocated: counted in the bound
        engine.post_optimizer_step()
        peaks.append(engine.last_step_stats.peak_memory_bytes - base)
    groups = [
        {
            "gather": g.gather_numel * g.gather_dtype.itemsize,
            "reduce": g.reduce_numel * g.reduce_dtype.itemsize,
            "full": g.gather_numel * world_size * g.gather_dtype.itemsize,
        }
        for g in engine._groups
    ]
    out = {"peaks": peaks, "groups": groups, "summary": engine.memory_summary()}
    engine.close()
    dist.barrier()
    return out
