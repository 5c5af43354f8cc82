"""The parity reference of the plain Trainer tests: a script's `transformers.Trainer` in one process, on the same
optimizer steps as an ODC run with ``odc_samples_per_step`` samples per step.

    python tests/helpers/loops/trainer_reference.py --samples_per_step 5 examples/trainer/run_clm.py --output_dir OUT ...

runs the script unchanged as ``__main__``, with transformers' ``Trainer`` replaced by a subclass that changes only
how it reads the training set: ``per_device_train_batch_size=1`` and ``gradient_accumulation_steps=samples_per_step``
(each optimizer step accumulates ``samples_per_step`` samples through the Trainer's own accumulation and loss
normalisation), in the order ODC's sampler draws its steps (`trl_reference._in_step_order`, a sequential sampler).
``--aux_token_share``: a MoE router's auxiliary term (which the model's forward adds to its loss) of each
microbatch weighted by its share of the step's non-padding tokens, the definition ODC trains it with. ``OUT`` gets
what the parity tests read from ODC runs: ``initial_params.pt``, ``final_params.pt`` and the script's
``trainer_state.json``.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from typing import Any


def main(argv: list[str]) -> None:
    import torch
    from torch.utils.data import SequentialSampler

    from odc_accelerate._compat import transformers as tcompat
    from tests.helpers.loops.trl_reference import _in_step_order, _params

    parser = argparse.ArgumentParser()
    parser.add_argument("--samples_per_step", type=int, required=True)
    parser.add_argument(
        "--aux_token_share",
        action="store_true",
        help="the router auxiliary term the model's forward adds weighted by each microbatch's share of the step's "
        "non-padding tokens (the definition ODC trains it with) instead of once per microbatch",
    )
    parser.add_argument("script")
    own, rest = parser.parse_known_args(argv)
    samples = own.samples_per_step

    class InStepOrder(tcompat.original_trainer()):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            training_args = kwargs["args"]
            training_args.per_device_train_batch_size = 1
            training_args.gradient_accumulation_steps = samples
            seed = training_args.data_seed if training_args.data_seed is not None else training_args.seed
            kwargs["train_dataset"] = _in_step_order(kwargs["train_dataset"], samples, seed)
            super().__init__(*args, **kwargs)

        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return SequentialSampler(self.train_dataset)

        def train(self, *args: Any, **kwargs: Any) -> Any:
            out = self.args.output_dir
            os.makedirs(out, exist_ok=True)
            torch.save(_params(self.model), os.path.join(out, "initial_params.pt"))
            result = super().train(*args, **kwargs)
            torch.save(_params(self.model), os.path.join(out, "final_params.pt"))
            return result

        if own.aux_token_share:

            def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> Any:
                batches, count = super().get_batch_samples(epoch_iterator, num_batches, device)
                self.step_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
                return batches, count

            def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
                # The forward adds coef x aux to a loss the Trainer neither divides by the accumulation steps (it is
                # normalised by num_items_in_batch) nor, in one process, multiplies by a world size.
                coef = model.router_aux_loss_coef
                model.router_aux_loss_coef = coef * int(inputs["attention_mask"].sum()) / self.step_tokens
                try:
                    return super().training_step(model, inputs, num_items_in_batch)
                finally:
                    model.router_aux_loss_coef = coef

    tcompat.replace_trainer(InStepOrder)
    script = os.path.abspath(own.script)
    sys.argv = [script, *rest]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
