"""The RLOO arms' script: ``odc_accelerate.scripts.rloo`` unchanged, on the GRPO arms' target-length completions.

    accelerate launch --config_file examples/rloo/configs/odc_cpu.yaml benchmarks/grpo/rloo_train.py \
        --odc true --max_steps 3 --logging_steps 1 --output_dir OUT

TRL's GRPOTrainer takes a ``rollout_func``, through which the GRPO arms' offline script stops each completion at its
prompt's real continuation length (`odc_accelerate.demo.TargetLengthRollout`); TRL's RLOOTrainer has none, and a
random model rarely samples EOS, so the offline RLOO script's completions would all run to ``max_completion_length``.
This script runs the offline RLOO script (its arguments, model, prompts, rewards and ``main``) with one change, the
same in both RLOO arms (FSDP2 and ODC): the trainer is `TargetLengthRLOOTrainer`, whose one-turn generation is the
GRPO arms' rollout. So every RLOO arm generates exactly as the GRPO arms do: the same ``generate`` call on the same
model, the same stopping, the same completion lengths per prompt; ODC's ``generate`` without ``synced_gpus`` and
FSDP2's with it are the trainer's own (`odc_accelerate.integrations.trl.online`), timed as each rank's generation.
"""

from __future__ import annotations

from typing import Any

from odc_accelerate.demo import TargetLengthRollout
from odc_accelerate.integrations.trl import ODCRLOOTrainer


class TargetLengthRLOOTrainer(ODCRLOOTrainer):
    """`ODCRLOOTrainer` (ODC on or off) whose completions are `TargetLengthRollout`'s: each one sampled by the trained
    model and stopped at its prompt's ``target_length`` (capped at ``max_completion_length``), as the GRPO arms'.

    The training dataset needs the offline ``prompt`` and ``target_length`` columns
    (`odc_accelerate.demo.offline_grpo_dataset`, the offline script's default); vLLM generation is refused.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.use_vllm:
            raise ValueError(
                "The RLOO arms generate with transformers, stopped at target lengths; drop --use_vllm for them."
            )
        self.target_rollout = TargetLengthRollout.from_dataset(self.train_dataset)
        # TRL hands one-turn generation the token ids of the prompts (`processing_class(text=prompts)`, as it
        # tokenizes plain-text prompts); the rollout looks prompts up by text.
        texts = list(self.target_rollout.targets)
        ids = self.processing_class(text=texts)["input_ids"]
        self._prompt_of_ids = {tuple(i): text for i, text in zip(ids, texts, strict=True)}

    def _generate_single_turn(self, prompt_ids: list, images: Any, multimodal_fields: Any) -> list:
        prompts = []
        for ids in prompt_ids:
            text = self._prompt_of_ids.get(tuple(ids))
            if text is None:
                raise KeyError(
                    f"A prompt of {len(ids)} tokens is none of the training dataset's: the RLOO arms generate to the "
                    "target lengths of the offline prompts only."
                )
            prompts.append(text)
        out = self.target_rollout(prompts, self)
        if [list(i) for i in out["prompt_ids"]] != [list(i) for i in prompt_ids]:
            raise RuntimeError("The rollout tokenized the prompts differently from the trainer.")
        return out["completion_ids"]


def main() -> None:
    """Parse the offline RLOO script's arguments and run its ``main`` with `TargetLengthRLOOTrainer`."""
    from odc_accelerate.scripts import rloo

    # The script builds its trainer by this module-level name; every other line of it runs unchanged.
    rloo.ODCRLOOTrainer = TargetLengthRLOOTrainer
    parser = rloo.make_parser()
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(fail_with_unknown_args=False)
    rloo.main(script_args, training_args, model_args, dataset_args, given=parser.given)


if __name__ == "__main__":
    main()
