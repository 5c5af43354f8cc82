"""What a plan needs of the plain `transformers.Trainer`: a loss ODC can make exact, a collator that collates the
microbatches a plan makes, and ODC's own training loader.

`check_token_mean_loss` refuses a loss that a plan would change (``average_tokens_across_devices=False`` with a loss
normalised by ``num_items_in_batch``, or the Trainer's own per-microbatch mean), `weights_batch_mean_loss` says when a
per-batch mean is weighted by ``rows x W / rows of the step``, `check_collator` refuses collators that cannot collate
samples of different lengths, and `check_step_loader` a ``get_train_dataloader`` that does not return ODC's loader.
The rules, collator by collator: docs/integrations.md, "The plain `transformers.Trainer`: `ODCTrainer`".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._compat import transformers as tcompat

__all__ = [
    "check_average_tokens",
    "check_collator",
    "check_step_loader",
    "check_token_mean_loss",
    "weights_batch_mean_loss",
]

#: What to use instead of a collator that cannot collate a planned microbatch.
COLLATOR_REMEDY = (
    "Use DataCollatorForLanguageModeling(tokenizer, mlm=False) (pads each microbatch to its longest sample, labels "
    "from input_ids with the padding ignored), or DataCollatorWithFlattening() (one packed row per microbatch), or "
    "group the texts into blocks of one length (run_clm's group_texts)."
)
#: The columns ``DataCollatorWithPadding`` gives the model as ``labels``.
LABEL_COLUMNS = ("labels", "label", "label_ids")


def is_trl_trainer(trainer: Any) -> bool:
    """Whether a TRL trainer class is among the trainer's bases (TRL's trainers compute and ODC weights their loss)."""
    return any(cls.__module__.split(".")[0] == "trl" for cls in type(trainer).__mro__)


def uses_trainer_loss(trainer: Any) -> bool:
    """Whether the trainer's ``compute_loss`` is `transformers.Trainer`'s own."""
    return getattr(type(trainer), "compute_loss", None) is tcompat.original_trainer().compute_loss


def _owner(trainer: Any, method: str) -> type:
    """The class whose ``method`` the trainer runs (the first in its MRO defining it)."""
    return next(cls for cls in type(trainer).__mro__ if method in vars(cls))


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def check_average_tokens(trainer: Any, what: str) -> None:
    """Refuse ``average_tokens_across_devices=False`` for a loss normalised by ``num_items_in_batch`` under a plan.

    Plain FSDP2 with the flag off divides each rank's summed token loss by that rank's own label tokens (and then
    averages the gradients over ranks): a function of which samples share a rank, which the plan chooses, so no
    plan reproduces it. With the flag on (the default) the loss is the mean over every label token of the step.

    Args:
        what (`str`): the loss, as the message names it.

    Raises:
        `ValueError`: naming the flag and what to set.
    """
    if trainer.args.average_tokens_across_devices:
        return
    raise ValueError(
        f"average_tokens_across_devices=False: {what} would be normalised on each rank by that rank's own label "
        "tokens, which depend on which samples an ODC plan puts on which rank, so no plan can compute what plain "
        "FSDP2 does with it. Set --average_tokens_across_devices true (the default): the loss is then the per-token "
        "mean over every label token of the step, what one process computes; or train without ODC and without "
        "odc_plan to keep it."
    )


def check_token_mean_loss(trainer: Any) -> None:
    """Refuse, under a plan, a plain Trainer's loss that no microbatch weight makes exact (see the module docstring).

    TRL's trainers are not checked here (their loss is weighted by their ODC class). A loss normalised by
    ``num_items_in_batch`` needs ``average_tokens_across_devices=True``; the Trainer's own loss needs a model that
    takes the loss keyword arguments (or a ``compute_loss_func``); a script's per-batch-mean loss is weighted by the
    step loop (`weights_batch_mean_loss`).

    Raises:
        `ValueError`: naming the setting or the model, and what to change.
    """
    if is_trl_trainer(trainer):
        return
    counted = bool(trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None)
    if not tcompat.loss_is_scaled_for_ga(trainer, 1 if counted else None):
        if uses_trainer_loss(trainer):
            model = trainer.accelerator.unwrap_model(trainer.model)
            raise ValueError(
                f"{type(model).__name__}.forward takes no loss keyword arguments (**kwargs), so the Trainer cannot "
                "pass it num_items_in_batch and its loss is a mean per microbatch, which depends on which samples an "
                "ODC plan puts together. Use a model whose forward accepts **kwargs (transformers' causal LMs do), or "
                "pass compute_loss_func=... that divides the summed token loss by num_items_in_batch."
            )
        return  # a script's per-batch mean: weighted by rows in the step loop
    what = (
        "the Trainer's own loss"
        if uses_trainer_loss(trainer)
        else f"the loss of {_name(_owner(trainer, 'compute_loss'))}.compute_loss (normalised by num_items_in_batch)"
    )
    check_average_tokens(trainer, what)


def weights_batch_mean_loss(trainer: Any, num_items_in_batch: Any) -> bool:
    """Whether a microbatch's loss is a mean over that microbatch, which the step loop weights by
    `odc_accelerate.loss.batch_mean_weight`: a plain Trainer (no TRL trainer among its bases) whose ``training_step``
    would divide the loss by the accumulation steps (`tcompat.loss_is_scaled_for_ga`)."""
    return not is_trl_trainer(trainer) and not tcompat.loss_is_scaled_for_ga(trainer, num_items_in_batch)


def step_items(trainer: Any, batch: Any, num_items_in_batch: Any) -> Any:
    """The ``num_items_in_batch`` a microbatch is trained with: the step's count, or `None` where the plain Trainer
    passes none (a batch without ``labels``, a model without loss keyword arguments and no ``compute_loss_func``), so
    that its ``compute_loss`` and ``training_step`` decide as they do without a plan. TRL's trainers always get it."""
    if is_trl_trainer(trainer) or tcompat.counts_loss_items(trainer, batch):
        return num_items_in_batch
    return None


def check_step_loader(trainer: Any, dataloader: Any) -> None:
    """Refuse, before the model is prepared, a training loader that is not ODC's step loader under a plan.

    Under a plan one loader item is a rank's whole step (its planned microbatches); a ``get_train_dataloader`` of a
    script's own (or of a library's Trainer subclass) yields the batches it collates itself, which the step loop
    cannot read as steps. An override that returns ``super().get_train_dataloader()`` passes.

    Raises:
        `ValueError`: naming the override and what to do.
    """
    if getattr(dataloader, tcompat.SKIPS_ITSELF_ATTR, False):
        return
    owner = _owner(trainer, "get_train_dataloader")
    raise ValueError(
        f"{_name(owner)}.get_train_dataloader returns a {type(dataloader).__name__} of batches of its own, but under "
        "an ODC plan each item of the training loader is a rank's whole optimizer step, planned by length from "
        "train_dataset and collated with data_collator. Remove the override and pass the samples as train_dataset "
        "and the collator as data_collator (an override may also return super().get_train_dataloader()); to train "
        "on the loader's own batches, train without ODC and without odc_plan."
    )


def _label_column(columns: list[str]) -> str | None:
    return next((name for name in LABEL_COLUMNS if name in columns), None)


def _per_token(value: Any) -> bool:
    """Whether a row's label is a sequence (one per token) rather than one value."""
    return np.ndim(value) > 0 if not isinstance(value, (str, bytes)) else False


def check_collator(collator: Any, lengths: np.ndarray, columns: list[str], first_row: Any = None) -> None:
    """Refuse, before training, a collator that cannot collate the microbatches a plan makes of samples of
    ``lengths`` (see the module docstring).

    Args:
        collator: the trainer's ``data_collator``.
        lengths (`np.ndarray`): every training sample's length.
        columns (`list[str]`): the training set's columns after the Trainer's unused-column removal (a dataset
            without named columns: the keys of ``first_row``).
        first_row (`dict`, *optional*): the first training sample (whether its label is one value or one per token).

    Raises:
        `ValueError`: naming the collator and what to use instead.
    """
    from transformers import DataCollatorWithFlattening, DataCollatorWithPadding, DefaultDataCollator
    from transformers.data.data_collator import default_data_collator

    lengths = np.asarray(lengths)
    one_length = lengths.size == 0 or int(lengths.min()) == int(lengths.max())
    spread = f"{int(lengths.min())} to {int(lengths.max())} tokens" if lengths.size else ""
    stacks = collator is default_data_collator or (
        isinstance(collator, DefaultDataCollator) and not isinstance(collator, DataCollatorWithFlattening)
    )
    if stacks and not one_length:
        name = "default_data_collator" if collator is default_data_collator else type(collator).__name__
        raise ValueError(
            f"The training samples are of different lengths ({spread}), and {name} stacks a microbatch's samples "
            f"without padding: it cannot collate the microbatches an ODC plan makes of several samples. "
            f"{COLLATOR_REMEDY}"
        )
    if isinstance(collator, DataCollatorWithPadding):
        if not columns and isinstance(first_row, dict):
            columns = list(first_row)
        label = _label_column(columns)
        if label is None:
            raise ValueError(
                "DataCollatorWithPadding (the Trainer's collator when given a tokenizer and no data_collator) gives the "
                "model no labels: it pads input_ids and attention_mask only, and the training set has no labels (or "
                f"label) column, so the model computes no loss. {COLLATOR_REMEDY}"
            )
        # Unknown without a row: taken as per-token (the case that needs one length).
        per_token = not isinstance(first_row, dict) or label not in first_row or _per_token(first_row[label])
        if per_token and not one_length:
            raise ValueError(
                f"The training samples are of different lengths ({spread}) with one label per token, and "
                "DataCollatorWithPadding pads input_ids and attention_mask but not labels: it cannot collate the "
                f"microbatches an ODC plan makes of several samples. {COLLATOR_REMEDY}"
            )
