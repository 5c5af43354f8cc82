"""The KTO trainer's pieces without a launch: lengths, the loss weight, the step's KL answers inside a microbatch, the
step's metrics from the deferred gathers, and the settings refused at set-up."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from odc_accelerate._compat.trl import kto as trl_kto
from odc_accelerate.config import ODCConfig
from odc_accelerate.integrations.trainer.metrics import DeferredGather, reduce_step_metrics
from odc_accelerate.integrations.trl.kto import (
    ODCKTOTrainer,
    _check_vision,
    check_kto_settings,
    finalize_kto_metrics,
    kto_loss_weight,
)


def _config(**options) -> ODCConfig:
    return ODCConfig.from_sources(overrides=options, env={})


# ------------------------------------------------------------------------------------------------ lengths and weights
def test_an_example_is_planned_by_its_longer_sequence_truncated_to_max_length():
    from datasets import Dataset

    data = Dataset.from_dict(
        {
            "prompt_ids": [[1] * 3, [1] * 2, [1] * 9],
            "completion_ids": [[2] * 4, [2] * 1, [2] * 9],
            "KL_completion_ids": [[2] * 9, [2] * 4, [2] * 1],
        }
    )
    stub = SimpleNamespace(args=SimpleNamespace(max_length=16))
    assert ODCKTOTrainer._odc_lengths(stub, data).tolist() == [12, 6, 16]
    assert ODCKTOTrainer._odc_lengths(stub, data.remove_columns("KL_completion_ids")).tolist() == [7, 3, 16]
    microbatches = [{"input_ids": torch.zeros(3, 7)}, {"input_ids": torch.zeros(1, 3)}]
    assert ODCKTOTrainer._odc_num_items(None, microbatches) == 4


def test_weighted_microbatch_means_give_the_mean_over_every_example_of_the_step():
    g = torch.Generator().manual_seed(0)
    losses = torch.rand(9, generator=g)
    ranks = [[losses[0:1], losses[1:4], losses[4:5]], [losses[5:9]]]  # 3 and 1 microbatches of unequal sizes
    world = len(ranks)
    # FSDP2 averages the ranks' gradients: (1/W) sum over ranks of each rank's weighted microbatch means
    step = sum(kto_loss_weight(len(mb), len(losses), world) * mb.nanmean() for mbs in ranks for mb in mbs) / world
    assert float(step) == pytest.approx(float(losses.mean()), rel=1e-6)
    assert float(sum(mb.nanmean() for mbs in ranks for mb in mbs) / 4) != pytest.approx(float(losses.mean()))


# --------------------------------------------------------------------------------------- the step's KL in a microbatch
class _Accelerator:
    def __init__(self, deferred):
        self.gather_for_metrics = deferred


def test_a_microbatch_sees_the_steps_kl_and_counts_and_its_gathers_are_still_recorded():
    deferred = DeferredGather()
    deferred.start_microbatch()
    trainer = SimpleNamespace(calculate_KL=True, aux_loss_enabled=False, accelerator=_Accelerator(deferred))
    trainer.model, trainer.precompute_ref_logps = torch.nn.Linear(1, 1), False
    trainer.model.is_gradient_checkpointing = False  # what TRL's `disable_gradient_checkpointing` reads
    trainer.ref_model, trainer.args = None, SimpleNamespace(gradient_checkpointing_kwargs=None)
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long)}
    names = trl_kto.kto_gathers(trainer, chosen=True, rejected=True)
    with trl_kto.step_kl_answers(trainer, kl=0.25, num_chosen=7.0, num_rejected=3.0):
        # TRL's `(KL_logps - ref_KL_logps).mean()`: the policy's call first, then the reference's
        policy, reference = trl_kto.policy_kl_logps(trainer, batch), trl_kto.reference_kl_logps(trainer, batch)
        assert float((policy - reference).mean()) == 0.25
        answers = [trainer.accelerator.gather_for_metrics(torch.tensor(float(i + 1))) for i in range(len(names))]
    assert float(answers[names.index("num_chosen")].sum()) == 7.0  # the step's, over every rank
    assert float(answers[names.index("num_rejected")].sum()) == 3.0
    assert float(answers[names.index("entropy_sum")].sum()) == names.index("entropy_sum") + 1  # this rank's own
    # what the step's reduction reads: every value as TRL passed it, in order
    assert [c[0] for c in deferred.calls[0]] == [float(i + 1) for i in range(len(names))]
    assert trainer.accelerator.gather_for_metrics is deferred and "_compute_kl_logps" not in vars(trainer)


def test_the_gathers_of_a_microbatch_follow_trls_order_and_the_steps_counts():
    trainer = SimpleNamespace(calculate_KL=True, aux_loss_enabled=False)
    both = trl_kto.kto_gathers(trainer, chosen=True, rejected=True)
    assert both[0] == "kl" and both[-2:] == ("rewards/rejected", "logps/rejected") and len(both) == 14
    assert "rewards/chosen" not in trl_kto.kto_gathers(trainer, chosen=False, rejected=True)
    no_kl = trl_kto.kto_gathers(SimpleNamespace(calculate_KL=False, aux_loss_enabled=True), chosen=True, rejected=True)
    assert "kl" not in no_kl and no_kl[-1] == "aux_loss"


# -------------------------------------------------------------------------------------------------------- the metrics
def _microbatch(deferred, g, rows, chosen_rows, aux=None):
    """Record one microbatch's gathers as TRL's `_compute_loss` makes them (its router's auxiliary term last, when
    given); its per-example values for the check."""
    labels = torch.zeros(rows, dtype=torch.bool)
    labels[:chosen_rows] = True
    tokens = torch.randint(1, 5, (rows,), generator=g).double()
    entropy, logits = torch.rand(rows, generator=g).double() * tokens, torch.randn(rows, generator=g).double()
    rewards, logps = torch.randn(rows, generator=g).double(), -torch.rand(rows, generator=g).double() * 10
    deferred.start_microbatch()
    gather = deferred
    gather(torch.tensor(0.1))  # kl: the step's value (not read back)
    gather(entropy.sum())
    gather(tokens.sum())
    gather(tokens.sum() + rows)  # input tokens
    for side in (labels, ~labels):
        gather((logits * tokens)[side].sum())
        gather(tokens[side].sum())
    gather(labels.sum())
    gather((~labels).sum())
    for side in (labels, ~labels):
        gather(rewards[side].nansum())
        gather(logps[side].nansum())
    if aux is not None:
        gather(torch.tensor(aux))
    return dict(labels=labels, tokens=tokens, entropy=entropy, logits=logits, rewards=rewards, logps=logps)


def test_step_metrics_are_trls_over_the_whole_step():
    g = torch.Generator().manual_seed(0)
    sizes = [[(2, 1), (3, 0)], [(1, 1)]]  # per rank: (examples, desirable ones) of each microbatch
    deferreds, seen = [], []
    for rank in sizes:
        deferred = DeferredGather()
        seen += [_microbatch(deferred, g, rows, chosen) for rows, chosen in rank]
        deferreds.append(deferred)
    rows = []
    for deferred in deferreds:
        reduce_step_metrics(deferred, lambda t, r=rows: r.append(t) or t, "cpu")
    metrics = reduce_step_metrics(deferreds[0], lambda t: torch.cat(rows), "cpu")
    whole = {k: torch.cat([s[k] for s in seen]) for k in seen[0]}
    labels, tokens = whole["labels"], whole["tokens"]

    class StandIn:
        """What the metrics read of TRL's KTOTrainer and of the ODC trainer."""

        calculate_KL, aux_loss_enabled = True, False
        odc_step_kl = 0.125

        def __init__(self, recorded, tokens):
            self._metrics = {"train": recorded}  # TRL's: a defaultdict(list)
            self._total_train_tokens = tokens
            self._odc_metric_marks = {"kl": 1, "entropy": 1}  # what the step found recorded before it

    recorded = defaultdict(list, {"kl": [9.0, 0.1, 0.1], "entropy": [9.0, 1.0, 1.0], "logits/chosen": [1.0]})
    trainer = StandIn(recorded, 100 + int(tokens[:5].sum() + 5))  # earlier steps, and rank 0's own gathers
    names = trl_kto.kto_gathers(trainer, chosen=True, rejected=True)
    finalize_kto_metrics(trainer, metrics, names)

    expected = {
        "kl": 0.125,
        "entropy": whole["entropy"].sum() / tokens.sum(),
        "logits/chosen": (whole["logits"] * tokens)[labels].sum() / tokens[labels].sum(),
        "rewards/chosen": whole["rewards"][labels].mean(),
        "logps/rejected": whole["logps"][~labels].mean(),
        "rewards/margins": whole["rewards"][labels].mean() - whole["rewards"][~labels].mean(),
    }
    assert recorded["kl"] == [9.0, 0.125] and recorded["entropy"][0] == 9.0 and len(recorded["logits/chosen"]) == 1
    for key, value in expected.items():
        assert recorded[key][-1] == pytest.approx(float(value), rel=1e-9), key
    assert recorded["num_tokens"] == [100 + int(tokens.sum() + len(tokens))]


def _aux_step(chosen: float, rejected: float):
    """What the router auxiliary loss's gather position and the metrics read of the ODC trainer: the step's counts."""

    class AuxStep:
        calculate_KL, aux_loss_enabled = True, True
        _odc_step_gathers = ODCKTOTrainer._odc_step_gathers
        _odc_aux_gather_position = ODCKTOTrainer._odc_aux_gather_position

    step = AuxStep()
    step._odc_kto_step = {"kl_sum": 0.0, "kl_pairs": 0.0, "num_chosen": chosen, "num_rejected": rejected}
    return step


def test_the_router_aux_loss_is_gathered_last_wherever_the_steps_counts_put_it():
    """TRL gathers a side's rewards and log-probs only when the step has examples of it: the aux_loss gather (the one
    weighted by the microbatch's share of the step's routed tokens) moves with the step's counts."""
    positions = {}
    for chosen, rejected in ((3.0, 2.0), (0.0, 5.0), (5.0, 0.0)):
        step = _aux_step(chosen, rejected)
        names = trl_kto.kto_gathers(step, chosen=chosen > 0, rejected=rejected > 0)
        positions[chosen, rejected] = step._odc_aux_gather_position
        assert names[step._odc_aux_gather_position] == "aux_loss"
    # after kl, entropy (2), num_tokens, the logits (4), the counts (2) and each present side's rewards and log-probs
    assert positions == {(3.0, 2.0): 14, (0.0, 5.0): 12, (5.0, 0.0): 12}


def test_the_logged_router_aux_loss_is_the_share_weighted_sum_of_the_step():
    """Each microbatch's aux_loss scaled by its share of the step's routed tokens (as the step loop scales it): the
    step logs their sum over every rank, the term the update trains."""
    g = torch.Generator().manual_seed(1)
    ranks = [[(2, 1, 1.5, 0.5), (1, 0, 3.0, 0.125)], [(2, 2, 2.5, 0.375)]]  # (examples, desirable, aux, share)
    stand_in, deferreds = SimpleNamespace(calculate_KL=True, aux_loss_enabled=True), []
    for rank in ranks:
        deferred = DeferredGather()
        for rows, chosen, aux, share in rank:
            _microbatch(deferred, g, rows, chosen, aux=aux)
            deferred.scale_call(len(trl_kto.kto_gathers(stand_in, True, True)) - 1, share)  # the last gather
        deferreds.append(deferred)
    gathered = []
    for deferred in deferreds:
        reduce_step_metrics(deferred, lambda t, r=gathered: r.append(t) or t, "cpu")
    metrics = reduce_step_metrics(deferreds[0], lambda t: torch.cat(gathered), "cpu")

    class StandIn:
        """What the metrics read of TRL's KTOTrainer and of the ODC trainer."""

        calculate_KL, aux_loss_enabled, odc_step_kl = True, True, 0.0

        def __init__(self, recorded):
            self._metrics = {"train": recorded}  # TRL's: a defaultdict(list)
            self._total_train_tokens = 0
            self._odc_metric_marks = {"aux_loss": 1}

    recorded = defaultdict(list, {"aux_loss": [7.0]})  # an earlier step's, kept
    trainer = StandIn(recorded)
    finalize_kto_metrics(trainer, metrics, trl_kto.kto_gathers(trainer, chosen=True, rejected=True))
    assert recorded["aux_loss"] == [7.0, pytest.approx(1.5 * 0.5 + 3.0 * 0.125 + 2.5 * 0.375)]


# ----------------------------------------------------------------------------------------------------------- refusals
def test_the_dynamic_plan_is_refused_by_name_and_the_others_pass():
    args = SimpleNamespace(sync_ref_model=False)
    with pytest.raises(ValueError, match=r"odc_plan 'dynamic' is not supported for KTO: .* Use --odc_plan free"):
        check_kto_settings(args, _config(enable=True, plan="dynamic"))
    for plan in ("free", "lockstep"):
        check_kto_settings(args, _config(enable=True, plan=plan))
    with pytest.raises(ValueError, match="sync_ref_model=True is not supported with ODC"):
        check_kto_settings(SimpleNamespace(sync_ref_model=True), _config(enable=True))


def test_a_vision_dataset_with_a_kl_estimate_is_refused_under_a_plan():
    vision = SimpleNamespace(calculate_KL=True, _is_vision_dataset=True)
    with pytest.raises(
        ValueError, match="TRL's vision collator pairs each prompt with the completion of its neighbour"
    ):
        _check_vision(vision, _config(enable=True))
    _check_vision(SimpleNamespace(calculate_KL=False, _is_vision_dataset=True), _config(enable=True))  # no KL
    _check_vision(vision, _config(enable=False))  # no plan: TRL's own microbatches


def test_a_batch_of_one_is_refused_before_any_work_and_apo_zero_unpaired_needs_no_kl(tmp_path):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from odc_accelerate.demo import load_offline_tokenizer
    from odc_accelerate.integrations.trl.configs import ODCKTOConfig
    from odc_accelerate.testing.models import tiny_causal_lm_config

    data = Dataset.from_dict({"prompt": ["a b", "c d"], "completion": [" e", " f"], "label": [True, False]})
    args = ODCKTOConfig(output_dir=str(tmp_path), per_device_train_batch_size=1, report_to="none", odc=True)
    with pytest.raises(ValueError, match=r"Actual \(not effective\) batch size must be > 1"):
        ODCKTOTrainer(
            model=AutoModelForCausalLM.from_config(tiny_causal_lm_config("untied")),
            args=args,
            train_dataset=data,
            processing_class=load_offline_tokenizer(),
        )
    assert trl_kto.kto_gathers(SimpleNamespace(calculate_KL=False, aux_loss_enabled=False), True, True)[0] != "kl"
