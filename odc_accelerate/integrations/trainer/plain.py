"""What a plan needs of the plain `transformers.Trainer`: its own token-mean loss, and a collator that collates the
microbatches a plan makes.

A plan puts samples of different lengths in one microbatch and runs a step as one accumulation step (the ODC
trainer loops the rank's microbatches itself), so:

* **Loss.** The Trainer's own ``compute_loss`` is exact under a plan when it normalises by ``num_items_in_batch``
  (the label tokens of the whole step over all ranks, which the ODC step loop counts as the Trainer does) and
  multiplies by the number of processes: that needs a model whose ``forward`` takes the loss keyword arguments (or a
  ``compute_loss_func``) and ``average_tokens_across_devices=True`` (the default). Otherwise the loss is a mean per
  microbatch, which depends on which samples the plan put together; `check_token_mean_loss` refuses it. A trainer that
  computes its own loss (TRL's, a script's ``compute_loss``) is not checked.
* **Collators.** Those that pad (``DataCollatorForLanguageModeling(mlm=False)``: labels from ``input_ids``, padding
  as -100) or pack (``DataCollatorWithFlattening``) collate any microbatch. ``default_data_collator`` (and
  ``DefaultDataCollator``) stack samples without padding, and ``DataCollatorWithPadding`` pads ``input_ids`` and
  ``attention_mask`` but not ``labels``: they collate only samples of one length; `check_collator` refuses them by name
  before training when the samples' lengths differ (run_clm's ``group_texts`` blocks are of one length).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._compat import transformers as tcompat

__all__ = ["check_collator", "check_token_mean_loss"]

#: What to use instead of a collator that cannot collate a planned microbatch.
COLLATOR_REMEDY = (
    "Use DataCollatorForLanguageModeling(tokenizer, mlm=False) (pads each microbatch to its longest sample, labels "
    "from input_ids with the padding ignored), or DataCollatorWithFlattening() (one packed row per microbatch), or "
    "group the texts into blocks of one length (run_clm's group_texts)."
)


def _uses_trainer_loss(trainer: Any) -> bool:
    return getattr(type(trainer), "compute_loss", None) is tcompat.original_trainer().compute_loss


def check_token_mean_loss(trainer: Any) -> None:
    """Refuse, under a plan, a Trainer whose own loss would be a mean per microbatch (see the module docstring).

    Raises:
        `ValueError`: naming the setting or the model, and what to change.
    """
    if not _uses_trainer_loss(trainer):
        return
    if not trainer.args.average_tokens_across_devices:
        raise ValueError(
            "average_tokens_across_devices=False: under an ODC plan each rank's loss would be normalised by its own "
            "label tokens, which depend on the plan. Leave average_tokens_across_devices at True (the default): the "
            "loss is then the per-token mean over every label token of the step, what one process computes."
        )
    if not (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None):
        model = trainer.accelerator.unwrap_model(trainer.model)
        raise ValueError(
            f"{type(model).__name__}.forward takes no loss keyword arguments (**kwargs), so the Trainer cannot pass it "
            "num_items_in_batch and its loss is a mean per microbatch, which depends on which samples an ODC plan "
            "puts together. Use a model whose forward accepts **kwargs (transformers' causal LMs do), or pass "
            "compute_loss_func=... that divides the summed token loss by num_items_in_batch."
        )


def check_collator(collator: Any, lengths: np.ndarray, columns: list[str]) -> None:
    """Refuse, before training, a collator that cannot collate the microbatches a plan makes of samples of
    ``lengths`` (see the module docstring).

    Args:
        collator: the trainer's ``data_collator``.
        lengths (`np.ndarray`): every training sample's length.
        columns (`list[str]`): the training set's columns after the Trainer's unused-column removal.

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
        if "labels" not in columns:
            raise ValueError(
                "DataCollatorWithPadding (the Trainer's collator when given a tokenizer and no data_collator) gives the "
                "model no labels: it pads input_ids and attention_mask only, and the training set has no labels "
                f"column, so the model computes no loss. {COLLATOR_REMEDY}"
            )
        if not one_length:
            raise ValueError(
                f"The training samples are of different lengths ({spread}), and DataCollatorWithPadding pads "
                "input_ids and attention_mask but not labels: it cannot collate the microbatches an ODC plan makes of "
                f"several samples. {COLLATOR_REMEDY}"
            )
