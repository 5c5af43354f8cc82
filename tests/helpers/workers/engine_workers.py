"""Per-rank training loops used by the engine tests (run through :func:`odc_accelerate.testing.launch`)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from odc_accelerate.engine import ODCEngine
from odc_accelerate.loss import loss_scale
from odc_accelerate.testing.models import ToyConfig, build_model, make_steps, shard_model, token_loss_sum
from tests.helpers.infra.dist_counter import count_dist_calls


def _mp_policy(precision: str):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if precision == "bf16-reduce":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    if precision == "bf16-compute":  # reduce_dtype left to FSDP2: bf16 before torch 2.15, fp32 from 2.15 on
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    return MixedPrecisionPolicy()


def _placement(spec: dict[str, Any], world_size: int):
    if not spec.get("shard_dim1"):
        return None
    from torch.distributed.tensor import Shard

    def place(param: torch.nn.Parameter):
        # Shard(1) needs even chunks along dim 1 in FSDP2.
        if param.ndim == 2 and param.shape[1] % world_size == 0:
            return Shard(1)
        return None

    return place


def full_params(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Unsharded fp32 copies of every parameter (collective: all ranks call it)."""
    out = {}
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name] = full.detach().float().cpu().numpy().copy()
    return out


def run_claimed(
    engine: ODCEngine,
    model: Any,
    queue: list[torch.Tensor],
    scale: float,
    drained: str | None = None,
    slow: bool = False,
) -> list:
    """One step of the dynamic plan on this rank: claim ``queue``'s microbatches one at a time and run each (its
    summed token loss times ``scale``, backward). Returns the claimed indices in the order run.

    ``drained``: a file this rank creates once it finds the queue empty. ``slow``: after each microbatch, wait until a
    peer has created ``drained`` (a slower device, made so by construction rather than by a sleep's length, which a
    loaded machine can outrun): a slow rank runs at most one microbatch per step, and its peers the rest.
    """
    mine = []
    for i in engine.claim_microbatches(len(queue)):
        mine.append(i)
        loss, _ = token_loss_sum(model, queue[i])
        (loss * scale).backward()
        if slow:
            _wait_for(drained, timeout=60.0)
    if drained is not None:
        Path(drained).touch()
    return mine


def _wait_for(path: str | None, timeout: float) -> None:
    if path is None:
        raise ValueError("a slow rank needs the drained file to wait for")
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no peer drained the queue ({path}) within {timeout} s")
        time.sleep(0.005)


def train(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Train the toy LM for ``spec["plan"]`` (steps x ranks x sequence lengths) with FSDP2 or ODC.

    Each microbatch's loss is its summed token loss times ``world / global tokens of the step``, so
    the result equals single-process training on the whole global batch.
    """
    if spec.get("pid_dir"):
        with open(os.path.join(spec["pid_dir"], f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    cfg = ToyConfig(**spec.get("cfg", {}))
    model = build_model(cfg, seed=spec.get("seed", 0))
    # Per-param gradient dtypes ({name: "bfloat16"}), which FSDP2 honours from torch 2.15 on (earlier releases drop
    # the setting when they shard the param).
    for name, dtype in spec.get("grad_dtypes", {}).items():
        model.get_parameter(name).grad_dtype = getattr(torch, dtype)
    # "two_groups": the blocks on a second process group over the same ranks (what torch's default mesh per
    # fully_shard call gives under a gloo default group on a CUDA machine).
    block_mesh = None
    if spec.get("two_groups"):
        from torch.distributed.device_mesh import DeviceMesh

        block_mesh = DeviceMesh.from_group(dist.new_group(list(range(world_size))), "cpu")
    model = shard_model(
        model,
        mp_policy=_mp_policy(spec.get("precision", "fp32")),
        shard_placement_fn=_placement(spec, world_size),
        block_mesh=block_mesh,
    )
    if spec.get("grad_divide_factor"):
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(spec["grad_divide_factor"])
                # gloo has no PREMUL_SUM: plain FSDP2 needs sum + post-divide for a custom factor.
                module.set_force_sum_reduction_for_comms(True)
    engine = None
    if spec["mode"] in ("odc", "odc_layersync"):
        engine = ODCEngine(
            model,
            transport=spec.get("transport", "auto"),
            timeout=spec.get("timeout", 60.0),
            sync_every_hook=spec["mode"] == "odc_layersync",
        )
    if spec.get("grad_dtypes"):
        # AdamW's state updates need each gradient in its param's dtype (which a param with its own grad_dtype
        # refuses); plain SGD adds any floating gradient into its param.
        optim = torch.optim.SGD(model.parameters(), lr=spec.get("lr", 1e-2), weight_decay=0.1, foreach=False)
    else:
        optim = torch.optim.AdamW(model.parameters(), lr=spec.get("lr", 1e-2), weight_decay=0.1)
    steps = make_steps(spec["plan"], cfg.vocab, seed=spec.get("data_seed", 1))
    counts, norms, grads, grad_dtypes, claimed = [], [], [], [], []
    kill_at = spec.get("kill_rank_at_step")
    for step_index, step in enumerate(steps):
        n_global = sum(ids.shape[1] - 1 for rank_mbs in step for ids in rank_mbs)
        scale = loss_scale(n_global, world_size) if n_global else 0.0
        if kill_at is not None and kill_at[0] == rank and kill_at[1] == step_index:
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.get("dynamic"):
            # The dynamic plan: the step's sequences in one queue (the same on every rank), claimed one at a time.
            queue = [ids for rank_mbs in step for ids in rank_mbs]
            with count_dist_calls() as calls:
                drained = os.path.join(spec["drain_dir"], f"step{step_index}") if spec.get("drain_dir") else None
                slow = spec.get("slow_rank") == rank
                claimed.append(run_claimed(engine, model, queue, scale, drained, slow))
        with count_dist_calls() as more_calls:
            for i, ids in enumerate([] if spec.get("dynamic") else step[rank]):
                if spec.get("no_sync"):
                    # accelerate's no_sync under FSDP2: reduce only after the last microbatch
                    model.set_requires_gradient_sync(i == len(step[rank]) - 1)
                loss, _ = token_loss_sum(model, ids)
                (loss * scale).backward()
        counts.append(dict(calls) | dict(more_calls) if spec.get("dynamic") else dict(more_calls))
        if spec.get("hang_rank") == rank:
            time.sleep(spec["hang_seconds"])
        if engine is not None:
            engine.pre_optimizer_step()
        if spec.get("record_grads"):
            grads.append(
                {
                    n: (p.grad.full_tensor().float().numpy().copy() if p.grad is not None else None)
                    for n, p in model.named_parameters()
                }
            )
            grad_dtypes.append({n: str(p.grad.dtype) for n, p in model.named_parameters() if p.grad is not None})
        clip = spec.get("clip")
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        optim.step()
        if (step_index + 1) % spec.get("zero_grad_every", 1) == 0:
            optim.zero_grad()
        if engine is not None:
            engine.post_optimizer_step()
    if spec.get("dynamic"):
        # misuse is refused: a second claim loop in one step, and claims after the step's gradients were folded
        first = engine.claim_microbatches(0)
        errors = []
        try:
            engine.claim_microbatches(0)
        except RuntimeError as err:
            errors.append(str(err))
        assert list(first) == []
        engine.pre_optimizer_step()
        try:
            engine.claim_microbatches(1)
        except RuntimeError as err:
            errors.append(str(err))
        engine.post_optimizer_step()
    result = {
        "params": full_params(model),
        "counts": counts,
        "claimed": claimed,
        "claim_errors": errors if spec.get("dynamic") else [],
        "norms": norms,
        "grads": grads,
        "grad_dtypes": grad_dtypes,
    }
    if engine is not None and spec.get("skip_close"):
        result["job_id"] = engine.transport.job_id
        return result  # interpreter exit must clean up
    if engine is not None:
        result["reduce_dtypes"] = [str(g.reduce_dtype) for g in engine._groups]
        result["job_id"] = engine.transport.job_id
        result["modes"] = sorted(
            oct(os.stat(os.path.join("/dev/shm", f)).st_mode & 0o777)
            for f in os.listdir("/dev/shm")
            if f.startswith(f"odc_{engine.transport.job_id}_r{rank}_")
        )
        own = f"odc_{engine.transport.job_id}_r{rank}_"
        result["shm_files"] = sorted(f for f in os.listdir("/dev/shm") if f.startswith(own))
        engine.close()
        result["shm_files_after_close"] = sorted(f for f in os.listdir("/dev/shm") if f.startswith(own))
    dist.barrier()
    return result


def reference(spec: dict[str, Any]) -> dict[str, np.ndarray]:
    """Single-process training on the whole global batch of every step (the ground truth)."""
    cfg = ToyConfig(**spec.get("cfg", {}))
    model = build_model(cfg, seed=spec.get("seed", 0))
    optim = torch.optim.AdamW(model.parameters(), lr=spec.get("lr", 1e-2), weight_decay=0.1)
    for step in make_steps(spec["plan"], cfg.vocab, seed=spec.get("data_seed", 1)):
        n_global = sum(ids.shape[1] - 1 for rank_mbs in step for ids in rank_mbs)
        for rank_mbs in step:
            for ids in rank_mbs:
                loss, _ = token_loss_sum(model, ids)
                (loss / n_global).backward()
        if spec.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec["clip"])
        optim.step()
        optim.zero_grad()
    return {n: p.detach().float().numpy().copy() for n, p in model.named_parameters()}


def frozen_forward(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Forward a frozen FSDP2 model served by a gather-only ODC engine: per-sequence summed token losses.

    ``spec["plan"][rank]`` lists this rank's sequence lengths (counts may differ per rank, including zero); the
    model is never trained. Returns the losses, the torch.distributed calls made during the forwards, the transport's
    buffer names and the errors the engine raised for misuse.
    """
    cfg = ToyConfig(**spec.get("cfg", {}))
    model = build_model(cfg, seed=spec.get("seed", 0))
    model.requires_grad_(False)
    model = shard_model(model, mp_policy=_mp_policy(spec.get("precision", "fp32")))
    engine = ODCEngine(model, timeout=60.0, frozen=True)
    steps = make_steps([spec["plan"]], cfg.vocab, seed=spec.get("data_seed", 1))
    losses = []
    with count_dist_calls() as calls, torch.no_grad():
        for ids in steps[0][rank]:
            loss, _ = token_loss_sum(model, ids)
            losses.append(float(loss))
    errors = {}
    for name in ("pre_optimizer_step", "post_optimizer_step"):
        try:
            getattr(engine, name)()
        except RuntimeError as err:
            errors[name] = str(err)
    result = {
        "losses": losses,
        "counts": dict(calls),
        "buffers": sorted(engine._buffers),
        "errors": errors,
        "gathers": engine.stats.gathers,
    }
    engine.close()
    dist.barrier()
    return result


def frozen_refuses_trainable(rank: int, world_size: int, spec: dict[str, Any]) -> str:
    """``ODCEngine(frozen=True)`` on a model with trainable parameters: the error message."""
    model = shard_model(build_model(ToyConfig(), seed=0))
    try:
        ODCEngine(model, timeout=60.0, frozen=True)
    except ValueError as err:
        return str(err)
    return "no error"


def names_gone_after_engine_setup(rank: int, world_size: int, spec: dict[str, Any]) -> dict[str, Any]:
    """The job's ``/dev/shm`` names right after ``ODCEngine(...)`` returns (before any step), then plain ODC training
    of ``spec["plan"]`` (one optimizer step per plan step, as :func:`train` without options) on the unlinked files.
    """
    cfg = ToyConfig(**spec.get("cfg", {}))
    model = shard_model(build_model(cfg, seed=spec.get("seed", 0)))
    engine = ODCEngine(model, transport="shm", timeout=60.0)
    job = engine.transport.job_id
    names = sorted(f for f in os.listdir("/dev/shm") if f.startswith(f"odc_{job}_"))
    optim = torch.optim.AdamW(model.parameters(), lr=spec.get("lr", 1e-2), weight_decay=0.1)
    for step in make_steps(spec["plan"], cfg.vocab, seed=spec.get("data_seed", 1)):
        n_global = sum(ids.shape[1] - 1 for rank_mbs in step for ids in rank_mbs)
        for ids in step[rank]:
            loss, _ = token_loss_sum(model, ids)
            (loss * loss_scale(n_global, world_size)).backward()
        engine.pre_optimizer_step()
        optim.step()
        optim.zero_grad()
        engine.post_optimizer_step()
    result = {"job_id": job, "names_after_setup": names, "params": full_params(model)}
    engine.close()
    dist.barrier()
    return result
