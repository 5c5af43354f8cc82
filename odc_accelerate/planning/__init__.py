"""Length-balanced step planning: cost models, the planner (``"free"`` / ``"lockstep"`` / ``"dynamic"``), padded
shapes, the sampler (map-style datasets) and the streaming planner (streams: `datasets.IterableDataset`).

Everything but the sampler is numpy only; the sampler (a `torch.utils.data.Sampler`) is imported on first use.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .cost import PUBLISHED_1_5B_COST, PUBLISHED_7B_COST, QuadraticCost, cost_from_config, flops_cost, resolve_cost
from .dynamic import claim_queue
from .padded import padded_microbatch, plan_padded
from .plan import PLANS, Plan, PlanName, check_oversize, normalize_plan, plan_from_costs, plan_step
from .stream import StepRows, StreamingStepPlanner, StreamStep

if TYPE_CHECKING:  # pragma: no cover
    from .sampler import LengthBalancedBatchSampler, dataset_lengths

__all__ = [
    "PLANS",
    "PUBLISHED_1_5B_COST",
    "PUBLISHED_7B_COST",
    "LengthBalancedBatchSampler",
    "Plan",
    "PlanName",
    "QuadraticCost",
    "StepRows",
    "StreamStep",
    "StreamingStepPlanner",
    "check_oversize",
    "claim_queue",
    "cost_from_config",
    "dataset_lengths",
    "flops_cost",
    "normalize_plan",
    "padded_microbatch",
    "plan_from_costs",
    "plan_padded",
    "plan_step",
    "resolve_cost",
]


def __getattr__(name: str) -> Any:
    if name in ("LengthBalancedBatchSampler", "dataset_lengths"):
        return getattr(import_module(".sampler", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
