"""`ODCTrainerMixin` on a TRL trainer ODC does not serve is refused by name when the trainer is constructed, before any
work and in any launch; the ODC classes, a subclass of one and the mixin on `transformers.Trainer` construct."""

from __future__ import annotations

import warnings

import pytest

from odc_accelerate import ODCTrainerMixin
from odc_accelerate.integrations.trl.unsupported import PLAIN_FSDP2, check_mixin_trainer


def _experimental(module: str, name: str) -> type:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's experimental-API warning
        return getattr(__import__(f"trl.experimental.{module}", fromlist=[name]), name)


def _refused(trl_class: type) -> str:
    class Mine(ODCTrainerMixin, trl_class):
        pass

    with pytest.raises(RuntimeError) as raised:
        Mine()  # no arguments: the check comes before the Trainer's own set-up reads any
    return str(raised.value)


@pytest.mark.parametrize(
    ("where", "name", "reason"),
    [
        ("orpo", "ORPOTrainer", "mean over the microbatch's pairs plus a mean NLL"),
        ("cpo", "CPOTrainer", "mean over the microbatch's pairs plus a mean NLL"),
        ("online_dpo", "OnlineDPOTrainer", "gather_object of the prompts"),
    ],
)
def test_the_mixin_on_a_refused_trl_trainer_stops_at_construction_naming_it(where, name, reason):
    if where.startswith("trl."):
        trl_class = getattr(__import__(where, fromlist=[name]), name)
    else:
        trl_class = _experimental(where, name)
    message = _refused(trl_class)
    assert message.startswith(f"ODC does not support TRL's {name}: "), message
    assert reason in message
    assert ".Mine puts ODCTrainerMixin on it, so it was stopped before training" in message
    assert message.endswith(f"drop ODCTrainerMixin from the bases and {PLAIN_FSDP2}.")


def test_a_trl_trainer_built_on_a_served_one_is_refused_too():
    gkd = _experimental("gkd", "GKDTrainer")  # TRL's GKD is an SFTTrainer with a teacher
    message = _refused(gkd)
    assert message.startswith("ODC has not been made for TRL's trl.experimental.gkd.gkd_trainer.GKDTrainer")
    kto = _experimental("kto", "KTOTrainer")  # TRL's experimental KTO, built on the stable one ODC serves
    assert _refused(kto).startswith("ODC has not been made for TRL's trl.experimental.kto.")
    distillation = _experimental("distillation", "DistillationTrainer")  # built on the stable one ODC serves
    assert _refused(distillation).startswith("ODC has not been made for TRL's trl.experimental.distillation.")
    bema_dpo = _experimental("bema_for_ref_model", "DPOTrainer")  # an experimental DPOTrainer, not TRL's own

    from odc_accelerate.integrations.trl import ODCDPOTrainer

    class OnTop(ODCDPOTrainer, bema_dpo):
        pass

    with pytest.raises(RuntimeError, match=r"made for TRL's trl\.experimental\.bema_for_ref_model"):
        OnTop()


def test_the_bare_mixin_on_a_served_trl_trainer_names_the_odc_class_to_build_on():
    from trl import DPOTrainer, GRPOTrainer, KTOTrainer

    served = ((DPOTrainer, "ODCDPOTrainer"), (GRPOTrainer, "ODCGRPOTrainer"), (KTOTrainer, "ODCKTOTrainer"))
    for trl_class, odc_class in served:
        message = _refused(trl_class)
        assert f"puts ODCTrainerMixin on TRL's {trl_class.__name__} directly" in message
        assert message.endswith(f"build it on `odc_accelerate.{odc_class}` instead (`class Mine({odc_class})`).")


def test_the_odc_classes_and_subclasses_of_them_pass():
    from transformers import Trainer

    from odc_accelerate import ODCTrainer
    from odc_accelerate.integrations.trl import (
        ODCDPOTrainer,
        ODCGRPOTrainer,
        ODCRewardTrainer,
        ODCRLOOTrainer,
        ODCSFTTrainer,
    )

    class OnTrainer(ODCTrainerMixin, Trainer):
        pass

    for cls in (ODCTrainer, ODCSFTTrainer, ODCDPOTrainer, ODCGRPOTrainer, ODCRLOOTrainer, ODCRewardTrainer, OnTrainer):
        mine = type("Mine", (cls,), {})
        for checked in (cls, mine):
            check_mixin_trainer(checked, ODCTrainerMixin)  # raises nothing


def test_a_subclass_of_an_odc_trainer_still_constructs(tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from odc_accelerate import ODCSFTConfig, ODCSFTTrainer
    from odc_accelerate.demo import load_offline_tokenizer
    from odc_accelerate.testing.models import tiny_causal_lm_config

    class MySFT(ODCSFTTrainer):
        pass

    class MyTrainer(ODCTrainerMixin, Trainer):
        pass

    model = AutoModelForCausalLM.from_config(tiny_causal_lm_config("tied", hidden_size=16))
    sft = MySFT(
        model=model,
        args=ODCSFTConfig(output_dir=str(tmp_path / "sft"), odc=False, report_to="none", max_length=16),
        train_dataset=Dataset.from_dict({"text": ["one two three four"] * 4}),
        processing_class=load_offline_tokenizer(),
    )
    plain = MyTrainer(model=model, args=TrainingArguments(output_dir=str(tmp_path / "plain"), report_to="none"))
    assert sft.odc_config.enable is False and plain.odc_config.enable is False
