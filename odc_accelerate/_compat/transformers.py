"""Every transformers Trainer internal that odc_accelerate overrides or reads, in one place, checked at start-up.

The Trainer has no public hook to pass an Accelerator plugin, to loop a rank's own microbatches inside one optimizer
step, to know the epoch a dataloader is built for, or to act after a checkpoint is loaded; the ODC mixin overrides
the private methods below. :func:`check` verifies they exist (with the keyword arguments the mixin relies on) and
raises naming what is missing, so a transformers upgrade fails at trainer construction instead of training wrongly.

The tested transformers versions are ``TESTED["transformers"]`` in :mod:`odc_accelerate._compat`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from . import CompatError, check_signature, import_attr, missing_message, patch_attribute, require, warn_if_untested

_LIBRARY = "transformers"

#: marks a dataloader that fast-forwards itself on resume: the Trainer's ``skip_first_batches`` returns it unchanged
SKIPS_ITSELF_ATTR = "_odc_skips_itself"

# method -> parameters the mixin passes or reads
_METHODS = {
    "create_accelerator_and_postprocess": (),
    "_build_accelerator_args": (),
    "get_batch_samples": ("epoch_iterator", "num_batches", "device"),
    "training_step": ("model", "inputs", "num_items_in_batch"),
    "_run_epoch": (
        "epoch",
        "train_dataloader",
        "resume_from_checkpoint",
        "epochs_trained",
        "steps_trained_in_current_epoch",
    ),
    "_load_from_checkpoint": ("resume_from_checkpoint",),
    "_track_num_input_tokens": ("inputs",),
    "_remove_unused_columns": ("dataset", "description"),
    "floating_point_ops": ("inputs",),
    "set_initial_training_values": ("args", "dataloader"),
    "get_total_train_batch_size": ("args",),
}


def check() -> None:
    """Raise `~odc_accelerate._compat.CompatError` if a Trainer internal the ODC mixin overrides is missing or
    changed shape."""
    detail = "The Trainer methods it overrides may behave differently there."
    warn_if_untested(_LIBRARY, detail)
    Trainer = original_trainer()  # noqa: N806 - transformers' own, also while `replace_trainer` swapped it
    for name, params in _METHODS.items():
        method = require(Trainer, name, library=_LIBRARY, where="transformers.Trainer")
        check_signature(method, params, library=_LIBRARY, where=f"transformers.Trainer.{name}")


def remove_unused_columns(trainer: Any, dataset: Any, description: str | None = None) -> Any:
    """``dataset`` as the Trainer's ``_remove_unused_columns`` leaves it: without the columns the model's forward does
    not accept (unchanged when ``args.remove_unused_columns`` is off). The method is checked by :func:`check`."""
    method = require(trainer, "_remove_unused_columns", library=_LIBRARY, where=type(trainer).__name__)
    return method(dataset, description=description)


def end_training(trainer: Any) -> None:
    """Finish the trackers and destroy the process group: ``trainer.end()`` (transformers 5.18+), else
    ``trainer.accelerator.end_training()``, which is what ``Trainer.end`` calls."""
    end = getattr(trainer, "end", None)
    if callable(end):
        end()
    else:
        trainer.accelerator.end_training()


def loss_shifts_labels(trainer: Any) -> bool:
    """Whether the model's loss shifts labels (causal LM): then label tokens are counted over ``labels[..., 1:]``."""
    return bool(getattr(trainer, "_loss_shifts_labels", True))


def count_label_tokens(trainer: Any, batch: dict) -> int:
    """Label tokens of one collated microbatch, counted as the Trainer's ``_get_num_items_in_batch`` counts them."""
    if "shift_labels" in batch:
        labels = batch["shift_labels"]
    elif "labels" in batch:
        labels = batch["labels"][..., 1:] if loss_shifts_labels(trainer) else batch["labels"]
    else:
        return 0
    return int(labels.ne(-100).sum())


def counts_loss_items(trainer: Any, batch: Any) -> bool:
    """Whether the Trainer passes ``num_items_in_batch`` for a step whose first microbatch is ``batch``: its
    ``_get_num_items_in_batch`` counts only when the batch has ``labels`` and the model takes the loss keyword arguments
    (or a ``compute_loss_func`` is set); otherwise it passes `None`."""
    return (
        isinstance(batch, Mapping)  # a collator's BatchEncoding too, as the Trainer reads it
        and "labels" in batch
        and bool(trainer.model_accepts_loss_kwargs or trainer.compute_loss_func is not None)
    )


def loss_is_scaled_for_ga(trainer: Any, num_items_in_batch: Any) -> bool:
    """Whether the Trainer's ``training_step`` takes ``compute_loss``'s value as already normalised over the whole
    accumulated batch (`True`) or as a mean per batch that it divides by the accumulation steps (`False`): the class's
    ``loss_is_scaled_for_ga`` when set (transformers 5.19+), else a loss normalised by ``num_items_in_batch`` (the
    model takes the loss keyword arguments and the count was passed) or by a ``compute_loss_func``."""
    own = getattr(trainer, "loss_is_scaled_for_ga", None)
    if own is not None:
        return bool(own)
    return bool(
        (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or trainer.compute_loss_func is not None
    )


@contextlib.contextmanager
def scaled_router_aux_loss_coef(model: Any, factor: float) -> Iterator[None]:
    """Within the block the forward of ``model`` (a transformers mixture-of-experts model, wrapped or not) adds its
    router's auxiliary loss to the loss it returns with ``factor`` times its coefficient.

    transformers' MoE causal LMs add ``self.router_aux_loss_coef * aux_loss`` when given labels (the attribute copied
    from the config in ``__init__``); composite (vision-language) ones read ``config.text_config.router_aux_loss_coef``.
    Both are scaled.

    Raises:
        `CompatError`: ``model`` holds neither (the release computes the term elsewhere).
    """
    holders = [m for m in model.modules() if isinstance(vars(m).get("router_aux_loss_coef"), (int, float))]
    configs = []
    for m in model.modules():
        config = getattr(m, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        for c in (config, text):
            if isinstance(getattr(c, "router_aux_loss_coef", None), (int, float)) and all(c is not k for k in configs):
                configs.append(c)
    if not holders and not configs:
        raise CompatError(
            missing_message(
                f"{type(model).__name__}.router_aux_loss_coef (or its config's)",
                library=_LIBRARY,
                advice="Load the model with output_router_logits=False to train without its router's auxiliary loss.",
            )
        )
    saved = [(m, vars(m)["router_aux_loss_coef"]) for m in holders] + [(c, c.router_aux_loss_coef) for c in configs]
    for obj, coef in saved:
        obj.router_aux_loss_coef = coef * factor
    try:
        yield
    finally:
        for obj, coef in saved:
            obj.router_aux_loss_coef = coef


def passthrough_skip_first_batches() -> None:
    """Make the Trainer's resume-time ``skip_first_batches`` a no-op for dataloaders marked with `SKIPS_ITSELF_ATTR`.

    On resume the Trainer re-creates the dataloader through accelerate's ``skip_first_batches`` (imported into
    ``transformers.trainer``), which cannot wrap a dataloader whose sampler yields whole steps. The ODC mixin
    fast-forwards its deterministic sampler itself (``load_state_dict``), so such a loader is returned unchanged.
    Idempotent: the name is wrapped once.
    """
    import transformers.trainer as trainer_mod

    where = "transformers.trainer"
    original = require(trainer_mod, "skip_first_batches", library=_LIBRARY, where=where)
    check_signature(original, ("dataloader", "num_batches"), library=_LIBRARY, where=f"{where}.skip_first_batches")

    def wrap(original: Any) -> Any:
        @functools.wraps(original)
        def skip_first_batches(dataloader: Any, num_batches: int = 0) -> Any:
            if getattr(dataloader, SKIPS_ITSELF_ATTR, False):
                return dataloader
            return original(dataloader=dataloader, num_batches=num_batches)

        return skip_first_batches

    patch_attribute(trainer_mod, "skip_first_batches", wrap, library=_LIBRARY, where=where)


def batch_rebalance_global_plans(
    lengths: list[int], effective_batch_size: int, dp_size: int, grad_accum: int
) -> list[list[list[list[int]]]]:
    """Every rank's microbatches from transformers' ``BatchRebalanceSampler``, step by step (for benchmarks).

    The sampler computes the whole step's assignment on every rank (``_assign``) and yields its own row
    (``_yield_global_batch``); capturing the row list once gives all ranks' plans without building one sampler per
    rank. ``shuffle=False``: the caller passes lengths already in its step order.
    """
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    where = "transformers.trainer_pt_utils.BatchRebalanceSampler"
    for attr, params in (("_assign", ("indices", "lengths")), ("_yield_global_batch", ("batch_indices",))):
        method = require(BatchRebalanceSampler, attr, library=_LIBRARY, where=where)
        check_signature(method, params, library=_LIBRARY, where=f"{where}.{attr}")

    class _Capture(BatchRebalanceSampler):
        def _yield_global_batch(self, batch_indices):
            yield self._assign(indices=batch_indices, lengths=[self.lengths[i] for i in batch_indices])

    sampler = _Capture(
        lengths=list(lengths),
        effective_batch_size=effective_batch_size,
        dp_size=dp_size,
        grad_accum=grad_accum,
        shuffle=False,
        rank=0,
        drop_last=True,
    )
    return list(sampler)


@contextlib.contextmanager
def generation_without_peer_sync(
    model: Any, sync: bool, around: Callable[[], contextlib.AbstractContextManager]
) -> Iterator[None]:
    """Within the block, ``model.generate`` keeps decoding only while this rank has unfinished sequences.

    `transformers.GenerationMixin.generate` turns on ``synced_gpus`` by itself for an FSDP-managed module when the
    world size is above 1: every rank keeps running forward passes (and one all-reduce per decode step) until the
    longest completion of any rank is done, because FSDP's per-layer all-gathers need every rank. ODC's gathers are
    one-sided reads, so with ``sync=False`` each rank passes ``synced_gpus=False`` and stops at its own last token.
    With ``sync=True`` transformers decides, as without ODC. Either way each ``generate`` call runs inside
    ``around()`` (the trainer's timing). The wrapper is an attribute of this model instance only, removed at the end.
    """
    from transformers import GenerationMixin

    original = require(model, "generate", library=_LIBRARY, where=f"{type(model).__name__}.generate")
    # transformers' own generate takes synced_gpus; a wrapper's (a PEFT model's generate(*args, **kwargs)) passes it on
    check_signature(
        GenerationMixin.generate, ("synced_gpus",), library=_LIBRARY, where="transformers.GenerationMixin.generate"
    )
    had_own = "generate" in vars(model)

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        if not sync:
            kwargs["synced_gpus"] = False
        with around():
            return original(*args, **kwargs)

    model.generate = generate
    try:
        yield
    finally:
        if had_own:
            model.generate = original
        else:
            del model.generate


def guard_trainer_train(check: Callable[[Any], None]) -> None:
    """Make ``transformers.Trainer.train`` call ``check(trainer)`` first: ``check`` raises to stop a run before it
    trains (`odc_accelerate.cli.bootstrap`). transformers' own ``Trainer`` is patched, also while `replace_trainer`
    swapped it, so every trainer (TRL's, the swapped-in class and its subclasses) is checked. Idempotent;
    `odc_accelerate._compat.restore_attribute` undoes it."""
    Trainer = original_trainer()  # noqa: N806

    def wrap(original: Any) -> Any:
        @functools.wraps(original)
        def train(self: Any, *args: Any, **kwargs: Any) -> Any:
            check(self)
            return original(self, *args, **kwargs)

        return train

    patch_attribute(Trainer, "train", wrap, library=_LIBRARY, where="transformers.Trainer")


def checkpoint_weights(model: Any, weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` (full tensors under ``model``'s own parameter names) renamed and laid out as a checkpoint of
    ``model`` stores them: transformers' ``revert_weight_conversion``, what ``save_pretrained`` applies (transformers
    5 fuses some weights in memory, e.g. a MoE layer's experts into ``experts.gate_up_proj`` / ``experts.down_proj``,
    which checkpoints and generation engines keep per expert). A model without conversions gets ``weights`` back.

    The conversions are whole-tensor renames and splits, so a subset of the model's weights (one FSDP unit) converts
    on its own as long as it holds every source of each conversion."""
    revert = import_attr("transformers.core_model_loading", "revert_weight_conversion", library=_LIBRARY)
    check_signature(revert, ("model", "state_dict"), library=_LIBRARY, where="revert_weight_conversion")
    return revert(model=model, state_dict=weights)


# ------------------------------------------------------------------------------ the Trainer class (odc_accelerate.cli)
#: The modules a script imports ``Trainer`` from: ``from transformers import Trainer`` reads the attribute of the lazy
#: ``transformers`` module (its ``__getattr__`` runs only while the attribute is absent, so an attribute set on it
#: wins), ``from transformers.trainer import Trainer`` the attribute of the module that defines it.
TRAINER_MODULES = ("transformers", "transformers.trainer")
#: transformers' own modules that subclass ``Trainer`` when imported (``Seq2SeqTrainer``): imported before the swap,
#: so that their classes keep the original base and are refused by name, not silently turned into ODC trainers.
TRAINER_SUBCLASS_MODULES = ("transformers.trainer_seq2seq",)
_TRAINER_REPLACED: dict[str, Any] = {}


def original_trainer() -> type:
    """transformers' own ``Trainer`` class, also while `replace_trainer` has put a subclass in its place."""
    import transformers.trainer as trainer_mod

    return _TRAINER_REPLACED.get("transformers.trainer") or require(
        trainer_mod, "Trainer", library=_LIBRARY, where="transformers.trainer"
    )


def replace_trainer(cls: type) -> None:
    """Make ``Trainer`` of `TRAINER_MODULES` return ``cls`` (a subclass of transformers' ``Trainer``): a script's
    ``from transformers import Trainer`` and ``class MyTrainer(Trainer)`` then get ``cls``. Classes already defined
    on the original (TRL's trainers, imported before this call, and those of `TRAINER_SUBCLASS_MODULES`) keep it.
    Idempotent; `restore_trainer` undoes it.

    Raises:
        TypeError: ``cls`` does not subclass transformers' ``Trainer``.
    """
    import importlib

    original = original_trainer()
    if not (isinstance(cls, type) and issubclass(cls, original) and cls is not original):
        raise TypeError(f"transformers.Trainer can only be replaced by a subclass of it, not {cls!r}.")
    for module_name in TRAINER_SUBCLASS_MODULES:
        importlib.import_module(module_name)  # bound to the original Trainer now, before the swap
    for module_name in TRAINER_MODULES:
        module = importlib.import_module(module_name)
        _TRAINER_REPLACED.setdefault(module_name, require(module, "Trainer", library=_LIBRARY, where=module_name))
        module.Trainer = cls


def restore_trainer() -> None:
    """Give back transformers' ``Trainer`` replaced by `replace_trainer`."""
    import sys

    for module_name, original in _TRAINER_REPLACED.items():
        sys.modules[module_name].Trainer = original
    _TRAINER_REPLACED.clear()


def attention_implementation(config: Any) -> str | None:
    """The attention implementation a model config selects (``"sdpa"``, ``"eager"``, ...; `None` when unset)."""
    return require(config, "_attn_implementation", library=_LIBRARY, where=type(config).__name__)
