"""DPO loss types whose value couples the pairs of a microbatch (a batch statistic, a sort) are refused under a plan,
naming the loss type and what to change; every loss type TRL offers is classified."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from odc_accelerate.integrations.trl.dpo import BATCH_COUPLED_LOSS_TYPES, PER_PAIR_LOSS_TYPES, check_dpo_loss_types

PLANNED, UNPLANNED = SimpleNamespace(balanced=True), SimpleNamespace(balanced=False)


@pytest.mark.parametrize(
    ("loss_type", "why"),
    [
        ("sft", "averages its NLL over the chosen tokens of each microbatch"),
        ("aot", "sorts the policy's and the reference's chosen-minus-rejected log-ratios within each microbatch"),
        ("aot_unpaired", "sorts the chosen and the rejected log-ratios within each microbatch"),
    ],
)
def test_a_batch_coupled_loss_type_is_refused_under_a_plan_with_what_to_change(loss_type, why):
    for given in ([loss_type], ["sigmoid", loss_type], loss_type):  # a list, a mixture, TRL's str form
        with pytest.raises(ValueError) as raised:
            check_dpo_loss_types(SimpleNamespace(loss_type=given), PLANNED)
        message = str(raised.value)
        assert message.startswith(f"loss_type {loss_type!r} {why}")
        assert "so its value depends on which pairs share a microbatch" in message
        assert f"Drop {loss_type!r} from --loss_type (and its --loss_weights entry)" in message
        assert message.endswith("or run without --odc / --odc_plan.")
    check_dpo_loss_types(SimpleNamespace(loss_type=[loss_type]), UNPLANNED)  # TRL's own microbatches: served


def test_per_pair_loss_types_pass_under_a_plan():
    check_dpo_loss_types(SimpleNamespace(loss_type=list(PER_PAIR_LOSS_TYPES)), PLANNED)
    check_dpo_loss_types(SimpleNamespace(loss_type=None), PLANNED)  # TRL's default


def test_every_loss_type_trl_offers_is_classified():
    """A loss type a TRL release adds fails here until it is put in one of the two lists."""
    from trl import DPOConfig

    offered = set(re.findall(r"`'([a-z_]+)'`", DPOConfig.__dataclass_fields__["loss_type"].metadata["help"]))
    assert len(offered) >= 15, offered
    assert offered == set(PER_PAIR_LOSS_TYPES) | set(BATCH_COUPLED_LOSS_TYPES)
    assert not set(PER_PAIR_LOSS_TYPES) & set(BATCH_COUPLED_LOSS_TYPES)
