"""The plain `transformers.Trainer` under the bootstrap: the class swap (`odc_accelerate.ODCTrainer` in place of
``transformers.Trainer``), what stays refused before training, and the collators and losses a plan refuses."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")


@pytest.fixture
def installed():
    from odc_accelerate.cli import bootstrap

    bootstrap.install()
    yield bootstrap
    from odc_accelerate._compat import restore_attribute
    from odc_accelerate._compat import transformers as transformers_compat
    from odc_accelerate._compat.trl import classes as trl_classes

    transformers_compat.restore_trainer()
    trl_classes.restore_public_classes()
    restore_attribute(transformers_compat.original_trainer(), "train")


def test_both_import_paths_and_a_script_subclass_give_odc_trainers(installed):
    import transformers
    import transformers.trainer
    from transformers import Trainer
    from transformers.trainer import Trainer as TrainerFromModule

    import odc_accelerate
    from odc_accelerate import ODCTrainer, ODCTrainerMixin
    from odc_accelerate._compat import transformers as transformers_compat

    original = transformers_compat.original_trainer()
    assert Trainer is TrainerFromModule is transformers.Trainer is ODCTrainer is odc_accelerate.ODCTrainer
    assert original is not ODCTrainer and issubclass(ODCTrainer, original)
    assert ODCTrainer.__mro__[1] is ODCTrainerMixin  # the mixin's methods come before the Trainer's

    class MyTrainer(Trainer):
        pass

    # the mixin written in as well: built without the repeated base, in the same order
    class WithMixin(ODCTrainerMixin, Trainer):
        pass

    for cls in (MyTrainer, WithMixin):
        assert issubclass(cls, ODCTrainerMixin) and cls.__mro__[1:] == ODCTrainer.__mro__
        installed.require_odc_trainer(object.__new__(cls))  # trains
    installed.install()  # twice changes nothing
    assert transformers.Trainer is ODCTrainer and transformers_compat.original_trainer() is original


def test_restore_gives_back_transformers_trainer(installed):
    import transformers
    import transformers.trainer

    from odc_accelerate._compat import transformers as transformers_compat

    original = transformers_compat.original_trainer()
    transformers_compat.restore_trainer()
    assert transformers.Trainer is original and transformers.trainer.Trainer is original
    with pytest.raises(TypeError, match="transformers.Trainer can only be replaced by a subclass of it"):
        transformers_compat.replace_trainer(dict)


def test_trl_trainers_keep_transformers_trainer_and_are_swapped_as_before(installed):
    import trl
    from trl.trainer.rloo_trainer import RLOOTrainer

    import odc_accelerate
    from odc_accelerate._compat import transformers as transformers_compat

    original = transformers_compat.original_trainer()
    assert trl.SFTTrainer is odc_accelerate.ODCSFTTrainer
    assert not issubclass(odc_accelerate.ODCSFTTrainer, odc_accelerate.ODCTrainer)
    assert original in odc_accelerate.ODCSFTTrainer.__mro__
    installed.require_odc_trainer(object.__new__(odc_accelerate.ODCSFTTrainer))
    # TRL's own class, imported from where TRL defines it after the swap, is still built on transformers' Trainer:
    # refused (the public name is the ODC trainer)
    assert trl.RLOOTrainer is odc_accelerate.ODCRLOOTrainer
    assert original in RLOOTrainer.__mro__ and not issubclass(RLOOTrainer, odc_accelerate.ODCTrainer)
    with pytest.raises(RuntimeError, match=r"trl\.trainer\.rloo_trainer\.RLOOTrainer, which is not an ODC trainer"):
        original.train(object.__new__(RLOOTrainer))


def test_seq2seq_trainer_is_refused_by_name_before_training(installed):
    from transformers import Seq2SeqTrainer

    from odc_accelerate._compat import transformers as transformers_compat

    assert Seq2SeqTrainer.__mro__[1] is transformers_compat.original_trainer()

    class MySeq2Seq(Seq2SeqTrainer):
        pass

    for cls in (Seq2SeqTrainer, MySeq2Seq):
        with pytest.raises(RuntimeError) as err:
            transformers_compat.original_trainer().train(object.__new__(cls))
        message = str(err.value)
        assert f"{cls.__module__}.{cls.__qualname__}, which is not an ODC trainer" in message
        assert "ODC does not support transformers' Seq2SeqTrainer" in message


def test_a_library_trainer_defined_on_the_swapped_trainer_is_refused(installed):
    from transformers import Trainer

    # what a transformers or TRL trainer class imported after the swap would be
    Library = type("LibraryTrainer", (Trainer,), {"__module__": "trl.trainer.new_trainer"})  # noqa: N806
    with pytest.raises(RuntimeError, match=r"trl\.trainer\.new_trainer\.LibraryTrainer, a trainer ODC does not"):
        installed.require_odc_trainer(object.__new__(Library))


def test_collators_that_cannot_collate_planned_microbatches_are_refused_by_name():
    from transformers import (
        DataCollatorForLanguageModeling,
        DataCollatorWithFlattening,
        DataCollatorWithPadding,
        DefaultDataCollator,
        default_data_collator,
    )

    from odc_accelerate.demo import load_offline_tokenizer
    from odc_accelerate.integrations.trainer.plain import check_collator

    tokenizer = load_offline_tokenizer()
    varied, one = np.array([5, 9, 30]), np.array([16, 16, 16])
    columns = ["input_ids", "attention_mask"]
    for fine in (DataCollatorForLanguageModeling(tokenizer, mlm=False), DataCollatorWithFlattening()):
        check_collator(fine, varied, columns)
    for stacks, name in ((default_data_collator, "default_data_collator"), (DefaultDataCollator(), "DefaultData")):
        check_collator(stacks, one, columns)  # samples of one length (run_clm's blocks) stack
        with pytest.raises(ValueError, match=rf"\(5 to 30 tokens\), and {name}.*DataCollatorForLanguageModeling"):
            check_collator(stacks, varied, columns)
    padding = DataCollatorWithPadding(tokenizer)
    check_collator(padding, one, [*columns, "labels"])
    with pytest.raises(ValueError, match="DataCollatorWithPadding pads input_ids and attention_mask but not labels"):
        check_collator(padding, varied, [*columns, "labels"])
    with pytest.raises(ValueError, match=r"no labels \(or label\) column, so the model computes no loss"):
        check_collator(padding, one, columns)


def test_data_collator_with_padding_serves_one_label_per_sample_of_any_length():
    from transformers import DataCollatorWithPadding

    from odc_accelerate.demo import load_offline_tokenizer
    from odc_accelerate.integrations.trainer.plain import check_collator

    padding = DataCollatorWithPadding(load_offline_tokenizer())
    varied, columns = np.array([5, 9, 30]), ["input_ids", "attention_mask"]
    # run_glue's case: a label column (renamed labels by the collator), one value per sample: nothing to pad
    for name in ("label", "labels", "label_ids"):
        check_collator(padding, varied, [*columns, name], first_row={"input_ids": [1] * 5, name: 1})
    # a torch dataset of dicts: no named columns, the row's keys
    check_collator(padding, varied, [], first_row={"input_ids": [1] * 5, "attention_mask": [1] * 5, "label": 0})
    # per-token labels of unequal length stay refused
    with pytest.raises(ValueError, match="with one label per token, and DataCollatorWithPadding pads input_ids"):
        check_collator(padding, varied, [*columns, "labels"], first_row={"input_ids": [1] * 5, "labels": [1] * 5})
    # the collator collates a microbatch of such samples
    batch = padding([{"input_ids": [1] * n, "attention_mask": [1] * n, "label": n % 2} for n in (2, 5)])
    assert batch["labels"].tolist() == [0, 1] and batch["input_ids"].shape == (2, 5)


class _Args:
    average_tokens_across_devices = True
    per_device_train_batch_size = 2
    gradient_accumulation_steps = 1
    world_size = 2


class _FakeTrainer:
    """What `check_token_mean_loss` reads of a Trainer."""

    def __init__(self, accepts: bool, average: bool = True, compute_loss_func=None):
        from odc_accelerate._compat import transformers as transformers_compat

        self.args = _Args()
        self.loss_is_scaled_for_ga = None
        self.args.average_tokens_across_devices = average
        self.model_accepts_loss_kwargs = accepts
        self.compute_loss_func = compute_loss_func
        self.model = object()
        self.accelerator = type("Accelerator", (), {"unwrap_model": staticmethod(lambda model: model)})()
        type(self).compute_loss = transformers_compat.original_trainer().compute_loss


def test_the_trainers_own_loss_must_be_a_token_mean_under_a_plan():
    from odc_accelerate.integrations.trainer.plain import check_token_mean_loss

    check_token_mean_loss(_FakeTrainer(accepts=True))
    check_token_mean_loss(_FakeTrainer(accepts=False, compute_loss_func=lambda *a, **k: 0))
    with pytest.raises(ValueError, match="object.forward takes no loss keyword arguments"):
        check_token_mean_loss(_FakeTrainer(accepts=False))
    with pytest.raises(ValueError, match="average_tokens_across_devices=False"):
        check_token_mean_loss(_FakeTrainer(accepts=True, average=False))

    class OwnLoss(_FakeTrainer):
        pass

    trainer = OwnLoss(accepts=False)
    OwnLoss.compute_loss = lambda self, *a, **k: 0  # a script's per-batch mean: weighted by rows, not refused
    check_token_mean_loss(trainer)


def test_average_tokens_across_devices_off_is_refused_for_every_loss_normalised_by_num_items():
    from odc_accelerate.integrations.trainer.plain import check_token_mean_loss, weights_batch_mean_loss

    class MyTrainer(_FakeTrainer):
        pass

    # a script's compute_loss that the Trainer takes as normalised by num_items_in_batch (the model takes the loss
    # keyword arguments): plain FSDP2 would normalise it by each rank's own label tokens, which the plan chooses
    trainer = MyTrainer(accepts=True, average=False)
    MyTrainer.compute_loss = lambda self, *a, **k: 0
    with pytest.raises(
        ValueError, match=r"average_tokens_across_devices=False: the loss of .*MyTrainer\.compute_loss"
    ):
        check_token_mean_loss(trainer)
    assert not weights_batch_mean_loss(trainer, 7)
    # its own mean per batch (the Trainer divides it by the accumulation steps): the flag does not enter it
    trainer.loss_is_scaled_for_ga = False
    check_token_mean_loss(trainer)
    assert weights_batch_mean_loss(trainer, 7) and weights_batch_mean_loss(trainer, None)
    # the Trainer's own loss with a model that takes no loss kwargs and no count passed: a mean per batch
    assert weights_batch_mean_loss(_FakeTrainer(accepts=False), None)


def test_sft_refuses_average_tokens_across_devices_off_under_a_plan():
    pytest.importorskip("trl")
    from odc_accelerate.config import ODCConfig
    from odc_accelerate.integrations.trl import ODCSFTTrainer

    trainer = object.__new__(ODCSFTTrainer)
    trainer.args = _Args()
    trainer.args.average_tokens_across_devices = False
    planned, unplanned = ODCConfig(enable=True, plan="free"), ODCConfig(enable=False)
    assert planned.balanced and not unplanned.balanced
    with pytest.raises(ValueError, match=r"average_tokens_across_devices=False: SFTTrainer's loss .* Set "):
        trainer._odc_check_settings(planned)
    trainer._odc_check_settings(unplanned)  # TRL's own microbatching counts per rank as it does alone
    trainer.args.average_tokens_across_devices = True
    trainer._odc_check_settings(planned)


def test_a_per_batch_mean_weighted_by_rows_is_the_mean_over_the_step_rows_whatever_the_plan():
    import torch

    from odc_accelerate.loss import batch_mean_weight

    torch.manual_seed(0)
    rows = torch.randn(9)  # one loss per row of a step of 9 rows
    plans = [  # per rank, its microbatches' rows
        [[[0, 1, 2, 3]], [[4, 5], [6], [7, 8]]],
        [[[0], [1], [2], [3], [4]], [[5, 6, 7, 8]]],
        [[[0, 1, 2, 3, 4, 5, 6, 7, 8]], []],
    ]
    for plan in plans:
        world = len(plan)
        # FSDP2 averages the ranks' gradients: the step's loss is the mean over ranks of each rank's sum
        loss = sum(sum(batch_mean_weight(len(mb), 9, world) * rows[mb].mean() for mb in rank) for rank in plan) / world
        assert float(loss) == pytest.approx(float(rows.mean()), rel=1e-6)


def test_a_microbatch_counts_its_rows_or_its_packed_sequences():
    import torch

    from odc_accelerate.integrations.trainer.data import microbatch_rows

    assert microbatch_rows({"input_ids": torch.zeros(3, 7), "attention_mask": torch.ones(3, 7)}) == 3
    packed = {"input_ids": torch.zeros(1, 7), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1]])}
    assert microbatch_rows(packed) == 3
    assert microbatch_rows({"input_ids": torch.zeros(1, 7), "cu_seq_lens_q": torch.tensor([0, 3, 7])}) == 2


class _Loaders:
    """What the ODC loaders' set-up reads of a trainer."""

    def __init__(self, balanced: bool = True):
        from odc_accelerate.config import ODCConfig
        from odc_accelerate.integrations.trainer import ODCRun

        self.odc_config = ODCConfig(enable=True, plan="free") if balanced else ODCConfig(enable=False)
        self.odc_run = ODCRun.derive(self.odc_config, _Args()) if balanced else ODCRun()
        self.odc_plans_from_dataset = True


def test_the_trainers_total_batch_size_is_the_planned_step():
    from odc_accelerate.integrations.trainer.loaders import ODCStepLoaders

    args = _Args()
    args.gradient_accumulation_steps = 3
    trainer = _Loaders()
    trainer.odc_run = type(trainer.odc_run).derive(trainer.odc_config, args)
    args.gradient_accumulation_steps = 1  # as the mixin folds it
    # per_device_train_batch_size 2 x gradient_accumulation_steps 3 x 2 ranks, not the 2 x 1 x 2 the Trainer counts
    assert ODCStepLoaders.get_total_train_batch_size(trainer, args) == 12 == trainer.odc_run.samples_per_step


def test_a_training_loader_of_the_scripts_own_is_refused_by_name_before_the_model_is_prepared():
    import torch
    from torch.utils.data import DataLoader

    from odc_accelerate.integrations.trainer.data import StepDataLoader, StepDataset
    from odc_accelerate.integrations.trainer.plain import check_step_loader

    class MyTrainer(_Loaders):
        def get_train_dataloader(self):
            return DataLoader([{"input_ids": torch.zeros(3)}], batch_size=1)

    trainer = MyTrainer()
    with pytest.raises(
        ValueError, match=r"test_plain_trainer\..*MyTrainer\.get_train_dataloader returns a DataLoader"
    ):
        check_step_loader(trainer, trainer.get_train_dataloader())
    check_step_loader(trainer, StepDataLoader(StepDataset([]), batch_size=None))  # ODC's own, from super()
