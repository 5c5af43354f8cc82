"""What ODC's online TRL trainers share (GRPO, RLOO): generate on each rank without a collective, then plan and train.

Generation: transformers' ``generate`` without ``synced_gpus`` over ODC's one-sided reads, or a colocated vLLM engine
refreshed from the published shards; TRL scores once per generation batch. Training: a generation batch's completions
are gathered once and feed ``num_iterations x steps_per_generation / gradient_accumulation_steps`` optimizer steps
(each of its slices, as TRL slices it, once per iteration); each step's completions are planned like SFT samples, each
microbatch's loss weighted by the trainer. A trainer puts `ODCOnlineTrainerMixin` first in its bases and supplies
``odc_rollout_keys``, ``odc_trl_module``, `_odc_init_context`, `_odc_check_trainer`, `_odc_check_settings`,
`_odc_loss_weight` and `_odc_finalize_metrics`. See docs/integrations.md.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from ..._compat import transformers as tcompat
from ..._compat.trl import grpo as trl_grpo
from ..accelerate import call_before_end_training
from ..trainer.budget import BudgetRule
from ..trainer.data import ZeroWeightMicrobatch
from ..trainer.dynamic import ClaimedStep, ClaimQueue
from ..trainer.moe import routed_tokens
from .online_checks import generation_slices, optimizer_steps_per_generation
from .rollouts import GRPO_KEYS, RolloutKeys, collate_rollouts, loss_tokens, split_rollouts, step_slices

__all__ = ["ODCOnlineTrainerMixin"]


class ODCOnlineTrainerMixin:
    """Generation without collectives and a planned step over the generated completions (see the module docstring),
    for TRL trainers with GRPOTrainer's generation structure (``_generate``, ``_generate_and_score_completions``,
    ``vllm_generation``, ``RepeatSampler``)."""

    odc_plans_from_dataset = False  # the step is planned after generation, from its completions (`_odc_plan`)
    #: The name of the trainer in messages (``"GRPO"``, ``"RLOO"``).
    odc_trainer_name: ClassVar[str] = "GRPO"
    #: The keys of the trainer's generation batch.
    odc_rollout_keys: ClassVar[RolloutKeys] = GRPO_KEYS
    #: The TRL module of the trainer, whose ``shuffle_sequence_dict`` shuffles a generation batch before its slices.
    odc_trl_module: ClassVar[str] = "trl.trainer.grpo_trainer"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._odc_ready = False  # inputs of the next training_step are already generated (plain path)
        self._odc_totals = (0, 0.0)  # completions and loss tokens of the step over all ranks (balanced path)
        # TRL's online trainers take (model, reward_funcs, args, train_dataset, ...): the prompts are checked in the
        # set-up (`_odc_check_settings`), before TRL builds any vLLM engine.
        self._odc_prompts = kwargs.get("train_dataset", args[3] if len(args) > 3 else None)
        # Balanced path: the completions of each optimizer step the current generation batch feeds (over all ranks),
        # its loss tokens over all ranks (TRL's num_items_in_batch; None for RLOO), and the steps trained on it.
        self._odc_generation: list[list[dict[str, torch.Tensor]]] | None = None
        self._odc_generation_items: torch.Tensor | None = None
        self._odc_generation_step = 0
        # Server mode without CUDA: TRL's client joins no NCCL weight-transfer group (ODC's sync reloads the server
        # from files, `_odc_sync_vllm_server`); TRL builds the client inside its __init__.
        with self._odc_init_context(), trl_grpo.vllm_server_without_communicator(self._odc_reloads_server_from_files):
            super().__init__(*args, **kwargs)
        self._odc_check_trainer()
        #: `VLLMSyncStats` of each weight sync of this rank's vLLM engine (ODC; in server mode, rank 0's pushes)
        self.odc_vllm_syncs: list[Any] = []
        self._odc_in_generation = False
        if self.use_vllm and self.odc_config.enable:
            # Each rank's own engine (colocate), or the server from rank 0 alone, refreshed from ODC's published
            # shards (no collective) instead of TRL's sync.
            trl_grpo.grpo_vllm_hooks(self, sync=self._odc_sync_vllm, around=self._odc_generation_block)
            if self.args.vllm_mode == "colocate":
                # vLLM's own tear-down would destroy the job's process group (the engine joined it): the engine goes
                # first, keeping the group, when the run ends (trainer.end() / accelerator.end_training()).
                call_before_end_training(self.accelerator, self._odc_shutdown_vllm)
        elif self.use_vllm and getattr(self.args, "vllm_mode", "colocate") == "colocate":
            # TRL's own sync and generation, timed as ODC's are (odc/generation_s: sync and vLLM's generate)
            trl_grpo.grpo_vllm_hooks(self, sync=None, around=self._odc_generation_block)

    # ------------------------------------------------------------------ what a trainer says
    def _odc_init_context(self) -> contextlib.AbstractContextManager:
        """What TRL's ``__init__`` runs inside (e.g. the reference model's preparer)."""
        return contextlib.nullcontext()

    def _odc_check_trainer(self) -> None:
        """Check the TRL internals the trainer reads (`odc_accelerate._compat`), once TRL's ``__init__`` ran."""

    def _odc_loss_weight(self, inputs: dict[str, Any], rows: int) -> float:
        """What a planned microbatch's loss, as TRL computes it, is multiplied by (see `.loss`)."""
        raise NotImplementedError

    def _odc_sequence_keys(self) -> tuple[str, ...]:
        """The keys of ``odc_rollout_keys.token_or_sequence`` that hold one value per completion in this run."""
        return ()

    # ------------------------------------------------------------------ set-up
    def get_train_dataloader(self) -> Any:
        if self.odc_config.balanced:
            from torch.utils.data import IterableDataset

            if isinstance(self.train_dataset, IterableDataset):
                raise ValueError(
                    f"ODC's balanced {self.odc_trainer_name} plan needs a map-style prompt dataset (one generation "
                    "batch per optimizer step); streamed prompts are not supported. Drop --dataset_streaming, or run "
                    "without --odc / --odc_plan."
                )
        return super().get_train_dataloader()  # TRL's prompt loader: the plan is made after generation

    def _get_train_sampler(self, dataset: Any = None) -> Any:
        sampler = super()._get_train_sampler(dataset)
        if self.odc_config.balanced:
            # One loader item per optimizer step: each generation batch's prompts once for every step it feeds.
            steps = optimizer_steps_per_generation(self.args, self.odc_run.folded_accumulation)
            trl_grpo.grpo_sample_per_step(sampler, steps)
        return sampler

    # ------------------------------------------------------------------ generation
    def _generate(self, prompts: list) -> Any:
        model = self.accelerator.unwrap_model(self.model_wrapped)
        sync = not self.odc_config.enable
        with tcompat.generation_without_peer_sync(
            model, sync, lambda: self.odc_step_timer.generation(self.args.device)
        ):
            return super()._generate(prompts)

    @contextlib.contextmanager
    def _odc_generation_block(self) -> Iterator[None]:
        """Time this rank's generation as busy and as ``odc/generation_s``: vLLM's ``generate`` and the weight sync
        before it (own work: ODC's reads and vLLM's reload, no wait for a peer). Nested blocks count once."""
        if self._odc_in_generation:
            yield
            return
        self._odc_in_generation = True
        try:
            with self.odc_step_timer.generation(self.args.device):
                yield
        finally:
            self._odc_in_generation = False

    def _odc_reloads_server_from_files(self, device: Any) -> bool:
        """Whether ODC's server-mode sync uses the ``"file"`` channel for a client on ``device`` (ODC on, no CUDA)."""
        from ..vllm_server import server_channel

        config = getattr(self, "odc_config", None)
        return bool(config is not None and config.enable and server_channel(torch.device(device)) == "file")

    def _odc_sync_vllm(self) -> None:
        if self.args.vllm_mode == "server":
            self._odc_sync_vllm_server()
        else:
            self._odc_sync_vllm_colocate()

    def _odc_sync_vllm_server(self) -> None:
        """Push the current weights to TRL's vLLM server from the main process alone, in place of TRL's
        ``sync_weights`` (whose ``full_tensor()`` gathers run on every rank): the full weights come from ODC's
        published shards (`odc_accelerate.integrations.vllm_server.push_weights_to_server`, no torch.distributed
        call). The other ranks do nothing here; they wait for the main process at the step's prompt gather."""
        from ..vllm_server import WEIGHTS_DIR, push_weights_to_server, server_channel

        engine = self._odc_engine_for_sync()
        if not self.accelerator.is_main_process:
            return
        client = trl_grpo.grpo_vllm_client(trl_grpo.grpo_vllm_generation(self))
        channel = server_channel(self.accelerator.device)
        weights_dir = os.path.join(self.args.output_dir, WEIGHTS_DIR)
        with self._odc_generation_block():
            stats = push_weights_to_server(client, engine, channel, weights_dir=weights_dir)
        self.odc_vllm_syncs.append(stats)

    def _odc_engine_for_sync(self) -> Any:
        engine = self.odc_engine
        if engine is None:
            raise RuntimeError(
                "ODC's vLLM weight sync runs once the model is prepared (trainer.train()); the ODC engine does not "
                "exist yet."
            )
        return engine

    def _odc_sync_vllm_colocate(self) -> None:
        """Refresh this rank's vLLM engine with the current weights, in place of TRL's ``sync_weights``: the full
        parameters come from ODC's published shards through the transport's reads, one FSDP unit at a time
        (`odc_accelerate.integrations.vllm.sync_vllm_weights`), with no torch.distributed call, so each rank syncs
        on its own. What TRL does around its sync is kept: waking the weights up first under sleep mode, and
        resetting vLLM's prefix cache after."""
        from ..vllm import sync_vllm_weights

        generation = trl_grpo.grpo_vllm_generation(self)
        engine = self._odc_engine_for_sync()
        with self._odc_generation_block():
            trl_grpo.wake_vllm_weights(generation)
            stats = sync_vllm_weights(trl_grpo.grpo_vllm_engine(generation), engine)
            trl_grpo.reset_vllm_prefix_cache(generation)
        self.odc_vllm_syncs.append(stats)

    def _odc_shutdown_vllm(self) -> None:
        """Shut this rank's vLLM engine down, keeping the job's process group (`shutdown_vllm`); idempotent."""
        from ..vllm import shutdown_vllm

        shutdown_vllm(trl_grpo.grpo_vllm_engine(trl_grpo.grpo_vllm_generation(self)))

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any) -> Any:
        # The reference (and old-policy) forwards after generation are own compute; inside a microbatch this is
        # already timed, and the nested block is a no-op.
        with self.odc_step_timer.compute(self.args.device):
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    # ------------------------------------------------------------------ step
    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: torch.device) -> tuple[list, Any]:
        # Items are lists of prompt rows; the step's work is known after generation (`_prepare_inputs`, `_odc_plan`).
        start = time.perf_counter()
        self._odc_banner()
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if batches:
            self.odc_step_timer.start(self.model, self.odc_engine, [], start)
        return batches, None

    def _prepare_inputs(self, inputs: Any) -> Any:
        if self._odc_looping or self._odc_ready:
            return inputs  # a microbatch built by the plan, or inputs generated by training_step
        prepared = super()._prepare_inputs(inputs)
        if self.model.training:
            self.odc_step_timer.add_work(1, int(prepared["prompt_mask"].sum() + prepared["completion_mask"].sum()))
        return prepared

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        if not self.odc_config.balanced:
            # TRL's own step (its accumulation slices); the loss's forward and backward are timed as busy, generation
            # and the reference forward by their own blocks.
            prepared = self._prepare_inputs(inputs)
            self._odc_ready = True
            try:
                with self.odc_step_timer.compute(self.args.device):
                    return super().training_step(model, prepared, num_items_in_batch)
            finally:
                self._odc_ready = False
        model.train()  # as Trainer.training_step does first: TRL's generation and metrics read the mode
        microbatches = self._odc_step_microbatches(inputs)
        return super().training_step(model, microbatches, self._odc_generation_items)

    def _odc_step_microbatches(self, inputs: list[dict[str, Any]]) -> Any:
        """This rank's microbatches of the optimizer step (`_odc_plan`). A generation batch feeds
        ``num_iterations x steps_per_generation / gradient_accumulation_steps`` steps, as in TRL: it is generated,
        scored and gathered at the first (`_odc_generate`, `_odc_gather_generation`), each following step trains its
        next slice, and each iteration trains the slices again (the steps' prompts from the loader, repeated by the
        sampler as TRL repeats them, are then set aside, as TRL sets them aside)."""
        steps = optimizer_steps_per_generation(self.args, self.odc_run.folded_accumulation)
        if self._odc_generation is None or self._odc_generation_step % steps == 0:
            # (None on the first step after a resume as well: TRL then generates too)
            self._odc_generation = self._odc_gather_generation(self._odc_generate(inputs))
            self._odc_generation_step = 0
        rows = self._odc_generation[self._odc_generation_step % len(self._odc_generation)]
        self._odc_generation_step += 1
        return self._odc_plan(rows)

    def _odc_generate(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """Generate and score a generation batch's completions as TRL does, once per generation batch."""
        args = self.args
        # TRL computes the old policy's log-probs (a no-gradient pass of the model before any update) when a
        # generation batch feeds more than one optimizer step (gradient_accumulation_steps not a multiple of
        # steps_per_generation x num_iterations): it decides on its own accumulation, which the trainer folded.
        folded, args.gradient_accumulation_steps = args.gradient_accumulation_steps, self.odc_run.folded_accumulation
        try:
            return trl_grpo.generate_and_score_completions(self, inputs)
        finally:
            args.gradient_accumulation_steps = folded

    def _odc_gather_generation(self, batch: dict[str, Any]) -> list[list[dict[str, torch.Tensor]]]:
        """Gather a generation batch's completions from every rank (one collective) and split them into the
        completions of each optimizer step it feeds (`step_slices`): each rank's rows shuffled first, as TRL shuffles
        them before slicing, when there is more than one such step. Sets ``_odc_generation_items`` to its loss tokens
        over all ranks, where TRL's loss reads them (GRPO's ``num_items_in_batch``; RLOO's loss none)."""
        from accelerate.utils import gather_object

        slices = generation_slices(self.args, self.odc_run.folded_accumulation)
        if slices > 1:
            batch = trl_grpo.shuffle_generation_batch(batch, self.odc_trl_module)
        rows = split_rollouts(batch, self._odc_sequence_keys(), self.odc_rollout_keys)
        per_rank = gather_object([rows]) if self.accelerator.num_processes > 1 else [rows]
        if "num_items_in_batch" in batch:
            total = float(sum(float(loss_tokens(r).sum()) for rows in per_rank for r in rows))
            self._odc_generation_items = torch.tensor(total, device=self.accelerator.device)
        else:
            self._odc_generation_items = None
        return step_slices(per_rank, slices)

    def _odc_plan(self, everyone: list[dict[str, torch.Tensor]]) -> Any:
        """Plan the step's completions (over all ranks, `_odc_gather_generation`) over ranks and microbatches, and
        return this rank's microbatches (under the ``dynamic`` plan: the step's queue, claimed while the step runs)."""
        from ...planning import PlanName, StreamingStepPlanner, claim_queue

        keys, sequence_keys = self.odc_rollout_keys, self._odc_sequence_keys()
        world = self.accelerator.num_processes
        lengths = [int(r["prompt_ids"].numel() + r["completion_ids"].numel()) for r in everyone]
        # By default the largest microbatch TRL itself would run; a completion over a budget set lower runs alone.
        longest_prompt = max(int(r["prompt_ids"].numel()) for r in everyone)
        rule = BudgetRule(
            default=int(self.args.per_device_train_batch_size) * (longest_prompt + int(self.max_completion_length)),
            oversize="warn",
        )
        budget = self._odc_budget(lengths, rule)
        planner = StreamingStepPlanner(
            world,
            max(len(everyone), world),
            int(budget),
            plan=self.odc_config.effective_plan,
            cost=self._odc_plan_cost(),
            padded=True,
        )
        plan = planner.plan(lengths)
        pad = trl_grpo.pad_token_id(self)
        device = self.accelerator.device
        total_tokens = float(sum(float(loss_tokens(r).sum()) for r in everyone))
        self._odc_totals = (len(everyone), total_tokens)
        # Every rank holds the step's completions: the routed tokens of a router's auxiliary loss without a collective
        self._odc_step_routed = sum(routed_tokens(r) for r in everyone) if self._odc_weights_router_aux() else 0
        # GRPO's loss reads the generation batch's loss tokens from its microbatches (its "global" types); RLOO none.
        num_items = self._odc_generation_items

        def collate(indices: list[int]) -> dict[str, Any]:
            mb = collate_rollouts([everyone[i] for i in indices], pad, device, sequence_keys, keys)
            if num_items is not None:
                mb["num_items_in_batch"] = num_items
            return mb

        if self.odc_config.effective_plan == PlanName.DYNAMIC:
            # Every rank holds every completion (gathered above); each collates only the microbatches it claims.
            def load(indices: list[int]) -> dict[str, Any]:
                mb = collate(indices)
                mb["odc_rows"] = len(indices)
                return mb

            return ClaimedStep(ClaimQueue(claim_queue(plan), rows=True), load)
        microbatches: list[Any] = []
        tokens = 0
        mine = plan[self.accelerator.process_index]
        for indices in mine:
            if indices:
                mb = collate(indices)
                mb["odc_rows"] = len(indices)
                tokens += int(mb["prompt_mask"].sum() + mb["completion_mask"].sum())
                microbatches.append(mb)
            elif not self.odc_config.enable:
                # An empty slot of the lockstep plan under plain FSDP2 still runs a forward and backward (its
                # collectives pair every rank's microbatches): a zero-weight microbatch (`ZeroWeightMicrobatch`, as
                # SFT's) of a real completion, unchanged, so that TRL's loss on it is finite (a masked-out filler
                # kept old_logps: exp(0 - old_logps) overflowed and inf x 0 wrote NaN into every gradient); the step
                # loop scales it by 0 and leaves it out of the loss and the metrics. ODC needs no filler.
                filler = next((ix[-1:] for ix in reversed(mine) if ix), [0])
                mb = collate(filler)
                mb["odc_rows"] = 0
                microbatches.append(ZeroWeightMicrobatch(mb))
        self.odc_step_timer.add_work(len(microbatches), tokens)
        return microbatches

    def _odc_count_claimed(self, batch: Any) -> None:
        self.odc_step_timer.add_work(1, int(batch["prompt_mask"].sum() + batch["completion_mask"].sum()))

    # A router's auxiliary loss: each microbatch's term weighted by its share of the step's routed tokens (`moe`);
    # TRL's GRPO and RLOO gather it first among a microbatch's metrics.
    _odc_serves_router_aux_loss = True
    _odc_aux_gather_position = 0

    def _odc_aux_divisor(self) -> float:
        """What TRL divides the router's auxiliary term by besides its coefficient (GRPO: the accumulation steps)."""
        return 1.0

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):
        if not self._odc_looping:
            return super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        rows = int(inputs["odc_rows"])
        weight = self._odc_loss_weight(inputs, rows) if rows else 0.0
        # TRL adds coef x aux / divisor to the loss the weight then multiplies: the router term's weighted share of the
        # step needs coef x share x W x divisor / weight (`moe`; a zero-weight microbatch's share is 0).
        scale = self.accelerator.num_processes * self._odc_aux_divisor() / weight if weight else 0.0
        with self._odc_router_coef(scale):
            loss = super().compute_loss(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        return loss * weight if rows else loss * 0.0

    def _track_num_input_tokens(self, inputs: Any) -> None:
        # TRL counts prompt and completion tokens itself once they are generated; the loader's items are prompts.
        return None

    def floating_point_ops(self, inputs: Any) -> int:
        return 0  # the loader's items are prompts: the Trainer's estimate would count nothing (as with TRL alone)
