"""Mixture-of-experts models under a plan: the router's load-balancing loss, and transformers' own expert parallelism.

* **The load-balancing loss** (TRL's ``router_aux_loss_coef``; transformers' ``load_balancing_loss_func``) is computed
  per forward from the router statistics of that microbatch's tokens: for each expert, the fraction of the tokens
  routed to it times its mean router probability. Plain FSDP2 with gradient accumulation adds each microbatch's term
  with weight ``1 / (W x G)``, so its value depends on how samples are grouped there too. Under a plan each
  microbatch's term is weighted by its share of the step's routed tokens (`routed_tokens`: the tokens its router
  statistics average over, over all ranks), the weights summing to one per step: a token counts the same whichever
  microbatch it ran in, as for the token loss. The TRL trainers that serve it scale TRL's coefficient per
  microbatch (`ODCTrainerMixin._odc_router_coef`); a plain Trainer's own loss (to which the model's forward adds the
  term) scales the model's (`ODCTrainerMixin._odc_plain_router_coef`); the others refuse it by name
  (`check_router_aux_loss`).
* **Expert parallelism** of transformers (``DistributedConfig(ep_size=..., enable_expert_parallel=True)`` or any
  ``distributed_config`` that shards, passed to ``from_pretrained``) has transformers call ``fully_shard`` and shard
  the experts itself, outside accelerate: refused at set-up (`check_transformers_distributed`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["check_router_aux_loss", "check_transformers_distributed", "router_aux_loss_coef", "routed_tokens"]


def routed_tokens(batch: Any) -> int:
    """The tokens a microbatch's router statistics average over: its non-padding tokens where it has an
    ``attention_mask`` (transformers' ``load_balancing_loss_func`` leaves padding out with it), else every token of
    its rows (a packed row has no padding). A generation batch's microbatch (GRPO, RLOO) runs its forward with the
    prompt and completion masks side by side as the attention mask: their ones."""
    if isinstance(batch, Mapping):
        if batch.get("prompt_mask") is not None and batch.get("completion_mask") is not None:
            return int(batch["prompt_mask"].sum()) + int(batch["completion_mask"].sum())
        mask = batch.get("attention_mask")
        if mask is not None and getattr(mask, "dim", lambda: 0)() == 2:
            return int(mask.sum())
        ids = batch.get("input_ids")
        if ids is not None:
            return int(ids.numel())
    return 0


def router_aux_loss_coef(model: Any, args: Any) -> float:
    """The weight of the router's auxiliary (load-balancing) loss a trainer adds to ``model``'s loss, 0.0 when none.

    A mixture-of-experts config that can return its router logits has ``output_router_logits``. TRL's trainers (whose
    arguments have ``router_aux_loss_coef``) add the loss for such a model unless the coefficient is 0, taking the
    config's own coefficient when the argument is unset; `transformers.Trainer` gets it from the model's forward,
    which adds it when the config has ``output_router_logits=True``.

    Args:
        model (`transformers.PreTrainedModel` or `peft.PeftModel`, *optional*):
            The model being trained (a PEFT model reads its base model's config).
        args (`transformers.TrainingArguments`):
            The training arguments (TRL's configs have ``router_aux_loss_coef``).
    """
    config = getattr(model, "config", None)
    if config is None:
        return 0.0
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if not hasattr(text, "output_router_logits"):
        return 0.0  # no router returning logits: not a mixture of experts with a load-balancing loss
    if hasattr(args, "router_aux_loss_coef"):
        coef = args.router_aux_loss_coef
        return float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0) if coef is None else float(coef)
    return float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0) if text.output_router_logits else 0.0


def _model_name(model: Any) -> str:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return f"{type(base).__name__} ({getattr(base.config, 'model_type', 'unknown model type')})"


def check_router_aux_loss(
    model: Any,
    args: Any,
    config: Any,
    trainer: type,
    coef: float | None = None,
    served: bool = False,
    loss: str | None = None,
) -> None:
    """Refuse a router auxiliary loss under a plan in a trainer that does not weight it, naming the model, the
    trainer and what to change. The ODC SFT, DPO, KTO, GRPO and RLOO trainers and a plain Trainer's own loss weight it
    (``served``): nothing to refuse.

    Args:
        model (`transformers.PreTrainedModel` or `peft.PeftModel`, *optional*):
            The model being trained.
        args (`transformers.TrainingArguments`):
            The training arguments.
        config (`ODCConfig`):
            The resolved ODC settings (their plan is named).
        trainer (`type`):
            The trainer's class (named).
        coef (`float`, *optional*):
            The coefficient the trainer decided on (TRL's ``router_aux_loss_coef`` once its loss is on); default:
            `router_aux_loss_coef` of ``model`` and ``args``.
        served (`bool`):
            Whether ``trainer`` weights the loss by each microbatch's share of the step's routed tokens.
        loss (`str`, *optional*):
            What computes a plain Trainer's loss instead of its own ``compute_loss`` (named in the message).

    Raises:
        `ValueError`: the loss is on and not served; the message names the model and the setting that turns it off.
    """
    coef = router_aux_loss_coef(model, args) if coef is None else coef
    if coef == 0.0 or served:
        return
    fix = (
        "Pass --router_aux_loss_coef 0 to train without it"
        if hasattr(args, "router_aux_loss_coef")
        else "Load the model with output_router_logits=False to train without it"
    )
    if loss is not None:
        raise ValueError(
            f"{_model_name(model)} adds its router's auxiliary load-balancing loss (router_aux_loss_coef={coef:g}) "
            f"once per microbatch, and {trainer.__name__}'s loss is computed by {loss}, so ODC cannot weight that term "
            f"by each microbatch's share of the step's tokens under the {config.plan!r} plan (it does for the "
            f"Trainer's own compute_loss, the model's loss as its forward returns it). {fix}, use the Trainer's own "
            "compute_loss, or run without --odc / --odc_plan to keep it."
        )
    raise ValueError(
        f"{_model_name(model)} adds its router's auxiliary load-balancing loss (router_aux_loss_coef={coef:g}) once "
        f"per microbatch, and {trainer.__name__} does not weight it by each microbatch's share of the step's tokens "
        f"under the {config.plan!r} plan (ODCSFTTrainer, ODCDPOTrainer, ODCKTOTrainer, ODCGRPOTrainer, ODCRLOOTrainer "
        f"and the Trainer's own loss do). {fix}, train with one of those, or run without --odc / --odc_plan to keep it."
    )


def check_transformers_distributed(model: Any) -> None:
    """Refuse a model that transformers distributed itself (``from_pretrained(..., distributed_config=...)`` with
    expert, tensor or FSDP parallelism): transformers then calls ``fully_shard`` on meshes of its own (and shards the
    experts across ranks), outside accelerate, so some parameter groups would train outside ODC.

    Raises:
        `ValueError`: naming the model, the settings and what to change.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    dist = getattr(getattr(base, "config", None), "distributed_config", None)
    if dist is None:
        return
    sizes = {
        name: int(getattr(dist, name, None) or 1) for name in ("ep_size", "tp_size", "fsdp_size", "dp_replicate_size")
    }
    asked = {name: size for name, size in sizes.items() if size > 1}
    if getattr(dist, "enable_expert_parallel", False) and "ep_size" not in asked:
        asked["enable_expert_parallel"] = True
    if not asked:
        return
    settings = ", ".join(f"{name}={value}" for name, value in asked.items())
    raise ValueError(
        f"{_model_name(model)} was loaded with distributed_config=DistributedConfig({settings}): transformers then "
        "shards it itself (fully_shard on meshes of its own, experts split across ranks), outside accelerate, so "
        "ODC cannot serve its parameters. Load the model without distributed_config (accelerate's FSDP2 under ODC "
        "shards the experts with the other weights), or train without ODC."
    )
