"""Resuming the ODC Trainer from a checkpoint: the exact data order, and the loaded shards published to the peers.

The sampler is deterministic (seed, epoch, step) and a stream is read in its own order, so skipping the trained
steps resumes the exact data order; after the Trainer loads weights, ``engine.republish()`` makes peers read the loaded
shards.
"""

from __future__ import annotations

from typing import Any

from .data import StepDataLoader, StreamStepDataset

__all__ = ["ODCResume"]


class ODCResume:
    """Part of `ODCTrainerMixin`: the epoch set-up of the step loaders and the engine after loading a checkpoint."""

    def _run_epoch(self, **kwargs: Any) -> Any:
        loader = kwargs.get("train_dataloader")
        steps = loader.dataset if isinstance(loader, StepDataLoader) else None
        if isinstance(steps, StreamStepDataset):
            resuming = kwargs.get("resume_from_checkpoint") is not None and kwargs["epoch"] == kwargs.get(
                "epochs_trained"
            )
            if resuming:
                # Exact resume: each optimizer step trained one step of the stream, so the stream restarts after as
                # many steps as the checkpoint trained (passes included); ignore_data_skip restarts it from the start.
                steps.start_step = 0 if self.args.ignore_data_skip else int(self.state.global_step)
            else:
                steps.start_step = steps.steps_consumed  # a later Trainer epoch continues the stream where it is
        sampler = self._odc_sampler
        if sampler is not None and isinstance(kwargs.get("train_dataloader"), StepDataLoader):
            # The Trainer only calls set_epoch on samplers it recognises; the plan depends on (seed, epoch, step).
            epoch = int(kwargs["epoch"])
            sampler.set_epoch(epoch)
            skip = int(kwargs.get("steps_trained_in_current_epoch") or 0)
            resuming = kwargs.get("resume_from_checkpoint") is not None and epoch == kwargs.get("epochs_trained")
            if resuming and skip and not self.args.ignore_data_skip:
                # Exact resume: start at the step an uninterrupted run would train next (no batch is fetched to be
                # thrown away; the Trainer's own skip is a no-op for this loader).
                sampler.load_state_dict({"epoch": epoch, "steps_consumed": skip, "seed": sampler.seed})
        return super()._run_epoch(**kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        engine = self.odc_engine
        if engine is not None:
            engine.republish()  # peers would otherwise read the shards published before loading
