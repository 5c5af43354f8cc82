"""Completions that stop at their prompt's real continuation length, as a trained policy's would (TRL's
``rollout_func``, or a per-prompt ``max_tokens`` for vLLM): a random model almost never samples EOS."""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

logger = logging.getLogger(__name__)


class TargetLengthStoppingCriteria(StoppingCriteria):
    """Per-row stop of `generate` once a row has generated its own number of new tokens.

    Args:
        prompt_length (`int`):
            Width of the (left-padded) prompt batch: tokens past it are generated.
        stop_after (`torch.Tensor` of shape `(batch,)`):
            Number of new tokens after which each row is done (at least 1).
    """

    def __init__(self, prompt_length: int, stop_after: torch.Tensor):
        self.prompt_length = prompt_length
        self.stop_after = stop_after

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        if self.stop_after.device != input_ids.device:
            self.stop_after = self.stop_after.to(input_ids.device)
        return self.stop_after <= input_ids.shape[1] - self.prompt_length


class TargetLengthRollout:
    """A ``rollout_func`` for `trl.GRPOTrainer` whose completions have the real lengths of the prompts' continuations.

    For each generation batch of a rank, the prompts are tokenized with the trainer's processing class and
    left-padded, and the model the trainer trains samples all completions in one ``generate`` call, with the
    trainer's generation settings (``do_sample``, ``temperature``, ``top_p``, ``top_k``, ...). A
    `TargetLengthStoppingCriteria` stops each row once it has its prompt's ``target_length`` tokens. A completion
    whose target fits in ``max_completion_length`` is then cut to its target and its last token is the EOS token, as
    a policy that stopped there would produce; a longer target is cut at ``max_completion_length`` without EOS, a
    truncated completion (TRL's ``completions/clipped_ratio``). A completion in which the model itself samples EOS
    earlier ends there. Generation runs on ``trainer.accelerator.unwrap_model(trainer.model_wrapped)`` under
    `torch.no_grad`, in eval mode, and the model's mode is restored after. ``synced_gpus`` is left to
    `transformers` (FSDP without ODC needs every rank to step together; the ODC GRPO trainer turns it off).

    Args:
        prompts (`Iterable[str]`):
            The dataset's prompts (the ``prompt`` column).
        target_lengths (`Iterable[int]`):
            The completion length of each prompt, in tokens (the ``target_length`` column).

    Example:

    ```python
    >>> dataset = offline_grpo_dataset()
    >>> trainer = GRPOTrainer(..., train_dataset=dataset, rollout_func=TargetLengthRollout.from_dataset(dataset))
    ```
    """

    def __init__(self, prompts: Iterable[str], target_lengths: Iterable[int]):
        self.targets: dict[str, int] = {}
        for prompt, target in zip(prompts, target_lengths, strict=True):
            if not isinstance(prompt, str):
                raise ValueError("TargetLengthRollout needs plain-text prompts (a `prompt` column of strings).")
            target = int(target)
            if target < 1:
                raise ValueError(f"Every target length must be at least 1, got {target} for prompt {prompt[:60]!r}.")
            if self.targets.setdefault(prompt, target) != target:
                raise ValueError(
                    f"The prompt {prompt[:60]!r} appears with two target lengths ({self.targets[prompt]} and "
                    f"{target}); give each distinct prompt one target_length."
                )

    @classmethod
    def from_dataset(cls, dataset: Any, prompt_column: str = "prompt", target_column: str = "target_length"):
        """Build the prompt -> target map from a `datasets.Dataset` (or any mapping of columns)."""
        missing = [c for c in (prompt_column, target_column) if c not in dataset.column_names]
        if missing:
            raise ValueError(
                f"TargetLengthRollout needs the dataset columns {missing}; build the dataset with "
                "odc_accelerate.demo.offline_grpo_dataset() or add them."
            )
        return cls(dataset[prompt_column], dataset[target_column])

    def limit_vllm(self, trainer: Any) -> None:
        """Stop each completion of the trainer's colocated vLLM engine (``use_vllm=True``, ``vllm_mode="colocate"``)
        at its prompt's target length, as `limit_vllm_to_target_lengths` describes; the rollout itself is then not
        passed to the trainer (TRL refuses a ``rollout_func`` next to its vLLM generation only in server mode, but
        would generate with transformers instead of vLLM).

        Raises:
            ValueError: the trainer does not generate with a colocated vLLM engine.
        """
        from .._compat.trl import grpo as trl_grpo

        if not getattr(trainer, "use_vllm", False) or getattr(trainer.args, "vllm_mode", None) != "colocate":
            raise ValueError(
                "TargetLengthRollout.limit_vllm needs a trainer generating with a colocated vLLM engine "
                "(use_vllm=True, vllm_mode='colocate'); otherwise pass the rollout as rollout_func."
            )
        engine = trl_grpo.grpo_vllm_engine(trl_grpo.grpo_vllm_generation(trainer))
        limit_vllm_to_target_lengths(engine, trainer.processing_class, self.targets)

    def __call__(self, prompts: list[str], trainer: Any) -> dict[str, Any]:
        unknown = [p for p in prompts if p not in self.targets]
        if unknown:
            raise KeyError(
                f"TargetLengthRollout has no target length for {len(unknown)} prompt(s), e.g. {unknown[0][:60]!r}: "
                "build it from the training dataset (TargetLengthRollout.from_dataset)."
            )
        generation_config = getattr(trainer, "generation_config", None)
        if generation_config is None:
            raise ValueError(
                "TargetLengthRollout generates with transformers and reads trainer.generation_config, which this "
                "trainer does not have (e.g. with --use_vllm true); drop the rollout or --use_vllm."
            )
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        return generate_to_target_lengths(
            model,
            trainer.processing_class,
            prompts,
            [self.targets[p] for p in prompts],
            generation_config,
            max_completion_length=trainer.args.max_completion_length,
            device=trainer.accelerator.device,
        )


def generate_to_target_lengths(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    targets: Sequence[int],
    generation_config: Any,
    max_completion_length: int,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """Sample one completion per prompt with ``model.generate``, each stopped at its own target length.

    The work of `TargetLengthRollout`, with its inputs spelled out: ``prompts`` are tokenized (as TRL tokenizes
    plain-text prompts) and left-padded, ``generation_config`` (sampling settings, ``pad_token_id``,
    ``eos_token_id``) drives one ``generate`` call with a `TargetLengthStoppingCriteria`, and each completion is cut
    to ``min(target, max_completion_length)`` tokens, its last token replaced by EOS when the target fits (see
    `TargetLengthRollout`).

    Returns:
        `dict` with ``prompt_ids`` and ``completion_ids`` (lists of token id lists, one per prompt) and ``logprobs``
        (`None`: like TRL's own transformers generation, no sampling log-probabilities are kept).
    """
    if len(prompts) != len(targets):
        raise ValueError(f"Got {len(prompts)} prompts and {len(targets)} targets.")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if eos is None:
        raise ValueError("TargetLengthRollout needs a tokenizer with an eos_token_id (the completions end with it).")
    device = device if device is not None else next(model.parameters()).device
    prompt_ids = tokenizer(text=list(prompts))["input_ids"]
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompt_ids):
        if ids:
            input_ids[row, width - len(ids) :] = torch.tensor(ids)
            attention_mask[row, width - len(ids) :] = 1
    lengths = [min(int(t), max_completion_length) for t in targets]
    # A row that will end with EOS needs only target - 1 sampled tokens; generate makes at least one.
    stop_after = torch.tensor(
        [max(1, n - 1) if t <= max_completion_length else n for n, t in zip(lengths, targets, strict=True)]
    )
    generation_config = generation_config.__class__.from_dict(generation_config.to_dict())
    generation_config.max_new_tokens = int(stop_after.max())
    criteria = StoppingCriteriaList([TargetLengthStoppingCriteria(width, stop_after)])
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=generation_config,
                stopping_criteria=criteria,
            )
    finally:
        model.train(was_training)
    sampled = out[:, width:].cpu().tolist()
    eos_ids = generation_config.eos_token_id
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids] if eos_ids is not None else [eos])
    completion_ids = []
    for tokens, n, target in zip(sampled, lengths, targets, strict=True):
        # The model's own EOS, if it samples one first, ends the completion there (as in TRL's generation).
        first_eos = next((i for i, tok in enumerate(tokens[:n]) if tok in eos_ids), None)
        if first_eos is not None:
            completion_ids.append(tokens[: first_eos + 1])
        elif target <= max_completion_length:
            completion_ids.append(tokens[: n - 1] + [eos])
        else:
            completion_ids.append(tokens[:n])
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


def limit_vllm_to_target_lengths(engine: Any, tokenizer: Any, targets: dict[str, int]) -> None:
    """Make ``engine.generate`` stop each prompt's completions at the prompt's target length.

    TRL's colocated vLLM generation calls ``llm.generate(prompts, sampling_params=...)`` with token-id prompts
    (``{"prompt_token_ids": [...]}``) and one `vllm.SamplingParams` for all. The wrapper, set on this engine object
    only, gives each prompt a copy whose ``max_tokens`` is ``min(max_tokens, target)``, looked up by the prompt's token
    ids (``tokenizer(text=prompt)``, as TRL tokenizes plain-text prompts). vLLM then samples each completion
    token by token as usual and ends it there (finish reason ``length``: unlike `TargetLengthRollout` with
    transformers, the last token is the sampled one, not EOS, so vLLM's log-probs stay those of the tokens kept). A
    completion in which the model samples EOS earlier ends there. Calls with a list of sampling parameters, with
    prompts of another form, or whose prompts are none of the dataset's (another use of the engine, e.g. an
    evaluation), are passed through unchanged; the last logs a warning once.

    Args:
        engine (`vllm.LLM`): the engine; its ``generate`` is wrapped on this object.
        tokenizer: the trainer's processing class.
        targets (`dict[str, int]`): target length of each plain-text prompt.

    Raises:
        KeyError: at ``generate``, a call mixing the dataset's prompts with others (a prompt tokenized differently).
    """
    prompts = list(targets)
    token_ids = tokenizer(text=prompts)["input_ids"]
    by_ids = {tuple(ids): int(targets[p]) for p, ids in zip(prompts, token_ids, strict=True)}
    original = engine.generate
    warned: list[bool] = []

    @functools.wraps(original)
    def generate(prompts: Any, sampling_params: Any = None, *args: Any, **kwargs: Any) -> Any:
        rows = prompts if isinstance(prompts, (list, tuple)) else [prompts]
        if sampling_params is None or isinstance(sampling_params, (list, tuple)):
            return original(prompts, sampling_params, *args, **kwargs)
        if not all(isinstance(row, dict) and "prompt_token_ids" in row for row in rows):
            return original(prompts, sampling_params, *args, **kwargs)
        found = [by_ids.get(tuple(row["prompt_token_ids"])) for row in rows]
        if all(target is None for target in found):
            if not warned:
                warned.append(True)
                logger.warning(
                    "vLLM generate() with prompts that are not the dataset's: generated with the caller's max_tokens, "
                    "not stopped at target lengths."
                )
            return original(prompts, sampling_params, *args, **kwargs)
        per_prompt = []
        for row, target in zip(rows, found, strict=True):
            if target is None:
                raise KeyError(
                    f"No target length for a prompt of {len(row['prompt_token_ids'])} tokens among the dataset's "
                    "prompts: the engine's prompts must be the dataset's, tokenized by the trainer's processing class."
                )
            params = sampling_params.clone()
            params.max_tokens = target if params.max_tokens is None else min(params.max_tokens, target)
            per_prompt.append(params)
        return original(prompts, per_prompt, *args, **kwargs)

    engine.generate = generate
