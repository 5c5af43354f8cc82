"""What a training process actually ran with, written by the examples for users and for the tests."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch

from ..telemetry import timed_dist_functions


def dump_initial_params(trainer: Any) -> None:
    """With ``ODC_DUMP_PARAMS=1``: the initial weights (before FSDP2 shards them), for the parity tests."""
    if os.environ.get("ODC_DUMP_PARAMS", "0") != "1" or not trainer.accelerator.is_main_process:
        return
    initial = {n: p.detach().float().cpu().clone() for n, p in trainer.model.named_parameters()}
    os.makedirs(trainer.args.output_dir, exist_ok=True)
    torch.save(initial, os.path.join(trainer.args.output_dir, "initial_params.pt"))


def write_run_report(trainer: Any, **extra: Any) -> None:
    """``OUT/odc_run_rank<r>.json``: distributed type, FSDP plugin, ODC engine, transport and last-step hook counts,
    resolved ODC options, the torch.distributed calls counted during microbatches (``ODC_COUNT_DIST_CALLS=1``) and
    ``extra``. With ``ODC_DUMP_PARAMS=1`` rank 0 also saves the full final parameters to ``OUT/final_params.pt``
    (collective)."""
    state = trainer.accelerator.state
    plugin = getattr(state, "fsdp_plugin", None)
    engine = trainer.odc_engine
    report = {
        "rank": trainer.accelerator.process_index,
        "world_size": trainer.accelerator.num_processes,
        "distributed_type": str(state.distributed_type),
        "fsdp_plugin": type(plugin).__name__ if plugin is not None else None,
        "fsdp_version": getattr(plugin, "fsdp_version", None),
        "engine": type(engine).__name__ if engine is not None else None,
        "transport": type(engine.transport).__name__ if engine is not None and engine.transport is not None else None,
        "engine_param_groups": len(engine.param_groups) if engine is not None else None,
        # hook calls and payload of this rank's last optimizer step (e.g. reduce-scatters per step)
        "engine_last_step": dataclasses.asdict(engine.last_step_stats)
        if engine is not None and engine.last_step_stats is not None
        else None,
        "odc_options": dataclasses.asdict(trainer.odc_options),
        "gradient_accumulation_steps": trainer.args.gradient_accumulation_steps,
        "microbatch_dist_calls": trainer.odc_microbatch_dist_calls,
        "timed_dist_functions": timed_dist_functions(),  # after training: none (the timer is closed)
        **extra,
    }
    if os.environ.get("ODC_DUMP_PARAMS", "0") == "1":
        params = {}
        for name, p in trainer.model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            params[name] = full.detach().to(torch.float32).cpu()
        if trainer.accelerator.is_main_process:
            torch.save(params, os.path.join(trainer.args.output_dir, "final_params.pt"))
    os.makedirs(trainer.args.output_dir, exist_ok=True)
    with open(os.path.join(trainer.args.output_dir, f"odc_run_rank{report['rank']}.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
