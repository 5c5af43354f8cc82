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

    from odc_accelerate.data import load_offline_tokenizer
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
    with pytest.raises(ValueError, match="no labels column, so the model computes no loss"):
        check_collator(padding, one, columns)


class _Args:
    average_tokens_across_devices = True


class _FakeTrainer:
    """What `check_token_mean_loss` reads of a Trainer."""

    def __init__(self, accepts: bool, average: bool = True, compute_loss_func=None):
        from odc_accelerate._compat import transformers as transformers_compat

        self.args = _Args()
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
    OwnLoss.compute_loss = lambda self, *a, **k: 0  # a trainer computing its own loss is not checked
    check_token_mean_loss(trainer)
