"""What the end-to-end benchmark runs: the arms (how a step is split and communicated) and the workloads (examples)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Arm:
    """One way to run the example: an accelerate config of the workload plus script arguments.

    Attributes:
        name (`str`): key in the results.
        label (`str`): what tables and plots show.
        config (`str` or `None`): accelerate config file in the workload's ``configs`` folder; `None`: the limit (W
            single processes without accelerate).
        args (`tuple[str, ...]`): extra script arguments.
        planned (`bool`): samples per step go through this package's sampler (``--odc_samples_per_step``).
        launch_args (`tuple[str, ...]`): extra ``accelerate launch`` arguments (they override the config file's).
    """

    name: str
    label: str
    config: str | None
    args: tuple[str, ...] = ()
    planned: bool = False
    launch_args: tuple[str, ...] = ()


ARMS: dict[str, Arm] = {
    a.name: a
    for a in (
        Arm("fsdp2_random", "FSDP2 + random", "fsdp2_cpu.yaml"),
        # TRL's KTO samples in dataset order (its KL completions are each example's neighbours in a fixed-order batch,
        # so it refuses any other sampler): its FSDP2 baseline.
        Arm(
            "fsdp2_sequential",
            "FSDP2 + sequential",
            "fsdp2_cpu.yaml",
            ("--train_sampling_strategy", "sequential"),
        ),
        Arm(
            "fsdp2_rebalance",
            "FSDP2 + batch_rebalance",
            "fsdp2_cpu.yaml",
            ("--train_sampling_strategy", "batch_rebalance"),
        ),
        Arm("fsdp2_lockstep", "FSDP2 + plan lockstep", "fsdp2_cpu.yaml", ("--odc_plan", "lockstep"), planned=True),
        # FSDP2's own way of keeping parameters gathered that the Trainer can use: no reshard after forward (gathered
        # once per microbatch; its gradients already stay unsharded until the last microbatch, the Trainer's no_sync).
        Arm(
            "fsdp2_rebalance_keep",
            "FSDP2 + rebalance, no reshard",
            "fsdp2_cpu.yaml",
            ("--train_sampling_strategy", "batch_rebalance"),
            launch_args=("--fsdp_reshard_after_forward", "false"),
        ),
        Arm("odc", "ODC + plan free", "odc_cpu.yaml", ("--odc", "true"), planned=True),
        Arm(
            "odc_dynamic",
            "ODC + plan dynamic",
            "odc_cpu.yaml",
            ("--odc", "true", "--odc_plan", "dynamic"),
            planned=True,
        ),
        # The step memory policy (odc_memory_policy): "odc" runs the default, neither.
        Arm(
            "odc_grads",
            "ODC + free, keep grads",
            "odc_cpu.yaml",
            ("--odc", "true", "--odc_memory_policy", "grads"),
            planned=True,
        ),
        Arm(
            "odc_both",
            "ODC + free, keep both",
            "odc_cpu.yaml",
            ("--odc", "true", "--odc_memory_policy", "both"),
            planned=True,
        ),
        # The dynamic plan's queue has more, smaller microbatches than the free plan: keeping parameters and
        # gradients through the step makes each of them free of communication. Compared with odc_both.
        Arm(
            "odc_dynamic_both",
            "ODC + dynamic, keep both",
            "odc_cpu.yaml",
            ("--odc", "true", "--odc_plan", "dynamic", "--odc_memory_policy", "both"),
            planned=True,
        ),
        # The ordered gradient reduction (docs/reduction.md): each rank sums its microbatches locally, each owner
        # reads and sums the ranks' contributions in rank order at the step boundary. Compared with "odc" (atomic).
        Arm(
            "odc_ordered",
            "ODC + plan free, ordered",
            "odc_cpu.yaml",
            ("--odc", "true", "--odc_reduction", "ordered"),
            planned=True,
        ),
        # DPO without padding: each microbatch's pairs packed into one row (TRL 1.16 pads every pair). Same plan and
        # communication as "odc"; on the DPO workload it is compared with the padded arms.
        Arm(
            "odc_packed",
            "ODC + plan free, packed",
            "odc_cpu.yaml",
            ("--odc", "true", "--padding_free", "true"),
            planned=True,
        ),
        Arm("limit", "limit (no comm)", None, ("--odc_plan", "free"), planned=True),
    )
}
BASELINES = ("fsdp2_random", "fsdp2_rebalance", "fsdp2_sequential")
"""The arms every other arm's speedup is reported against."""


@dataclass(frozen=True)
class Workload:
    """One example script and its default sizes. To add a benchmark, add an entry to `WORKLOADS`.

    Attributes:
        name (`str`): the command line's workload argument and the results folder's name.
        script (`str`), configs (`str`): paths relative to the repository root.
        batch (`int`), grad_accum (`int`), max_length (`int`), max_steps (`int`): defaults of the full run.
        arms (`tuple[str, ...]`): arms run by default (the limit is added unless ``--no_limit``).
        replaced (`dict`): argument values the offline example silently replaces (its CPU defaults): refused.
        args (`tuple[str, ...]`): script arguments for every arm.
        planned_args (`tuple[str, ...]`): script arguments for the arms on this package's plan (which pack several
            samples into one microbatch).
        unsupported (`dict[str, str]`): arms that cannot run on this workload, with the reason.
        config_files (`dict[str, str]`): accelerate config files that replace the arms' own (e.g. the HSDP versions);
            the world size is the ODC arm's config's ``num_processes``.
        data (`str`, *optional*): a dataset every arm trains on instead of the script's offline default, written once
            per benchmark run into ``OUT/data`` by ``benchmarks.e2e.data.DATASETS[data]`` and passed as
            ``--dataset_name`` (unless the script arguments name one).
        min_batch (`int`): the smallest ``--batch`` the script accepts (a smaller one is refused before any run).
        quick (`dict`): this workload's overrides of `QUICK` (the ``--quick`` defaults).
    """

    name: str
    script: str
    configs: str
    batch: int
    grad_accum: int
    max_length: int
    max_steps: int
    arms: tuple[str, ...] = ("fsdp2_random", "fsdp2_rebalance", "fsdp2_lockstep", "odc", "odc_dynamic")
    replaced: dict[str, int] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    planned_args: tuple[str, ...] = ()
    unsupported: dict[str, str] = field(default_factory=dict)
    config_files: dict[str, str] = field(default_factory=dict)
    data: str | None = None
    min_batch: int = 1
    quick: dict[str, Any] = field(default_factory=dict)

    def config_of(self, arm: Arm) -> str | None:
        """The accelerate config file ``arm`` runs with on this workload (`None`: the limit)."""
        return None if arm.config is None else self.config_files.get(arm.config, arm.config)


WORKLOADS: dict[str, Workload] = {
    "sft": Workload(
        "sft",
        "examples/sft/train.py",
        "examples/sft/configs",
        batch=1,
        grad_accum=4,
        max_length=512,
        max_steps=6,
        replaced={"max_length": 1024, "per_device_train_batch_size": 8},
        # A plan packs several samples into one microbatch: padding-free collation (one packed row, each sequence
        # attending to itself) computes no padding. The FSDP2 random / batch_rebalance arms run one sample per
        # microbatch, which has no padding either way.
        planned_args=("--padding_free", "true"),
        unsupported={"odc_packed": "the planned SFT arms already collate padding-free: it would be the odc arm"},
    ),
    "dpo": Workload(
        "dpo",
        "examples/dpo/train.py",
        "examples/dpo/configs",
        batch=1,
        grad_accum=2,
        max_length=512,
        max_steps=5,
        arms=("fsdp2_random", "fsdp2_lockstep", "odc", "odc_dynamic", "odc_packed"),
        replaced={"max_length": 1024, "per_device_train_batch_size": 8},
        unsupported={
            "fsdp2_rebalance": "transformers' BatchRebalanceSampler reads lengths from an `input_ids` or `length` "
            "column; TRL's tokenized preference data has prompt_ids / chosen_ids / rejected_ids only, so the Trainer "
            "raises before training (it would need a `length` column added after tokenization)",
        },
    ),
    # A reward model on the long-tailed preference pairs (a pair: chosen and rejected rows padded to the longer). The
    # pairs carry a `length` column (benchmarks.e2e.data.reward_pairs) that BatchRebalanceSampler reads, and the
    # Trainer keeps it (--remove_unused_columns false); TRL's collator ignores it.
    "reward": Workload(
        "reward",
        "examples/reward/train.py",
        "examples/reward/configs",
        batch=1,
        grad_accum=2,
        max_length=512,
        max_steps=5,
        arms=("fsdp2_random", "fsdp2_rebalance", "odc"),
        replaced={"max_length": 1024, "per_device_train_batch_size": 8},
        args=("--remove_unused_columns", "false"),
        data="reward_pairs",
        unsupported={"odc_packed": "the reward trainer pads a pair's rows; packing them is the DPO trainer's"},
    ),
    # KTO on the DPO example's preference pairs, unpaired by TRL (each chosen completion desirable, each rejected one
    # undesirable: the KTO example's offline default). Each example also runs its KL sequence (its prompt with a
    # neighbour's completion, no gradient) through the policy and the reference: in every microbatch under TRL, once
    # per step under a plan. TRL needs 2+ examples per microbatch for its KL estimate and sequential sampling.
    "kto": Workload(
        "kto",
        "examples/kto/train.py",
        "examples/kto/configs",
        batch=2,
        grad_accum=2,
        max_length=512,
        max_steps=5,
        arms=("fsdp2_sequential", "fsdp2_lockstep", "odc"),
        min_batch=2,
        quick={"arms": ("fsdp2_sequential", "odc"), "batch": 2, "grad_accum": 1},
        unsupported={
            **dict.fromkeys(
                ("fsdp2_random", "fsdp2_rebalance", "fsdp2_rebalance_keep"),
                "TRL's KTO trainer refuses any sampler but `sequential` (the KL completion of each example is its "
                "neighbour's in a fixed-order batch); its FSDP2 baseline is fsdp2_sequential",
            ),
            **dict.fromkeys(
                ("odc_dynamic", "odc_dynamic_both"),
                "KTO's per-step KL estimate runs over each rank's microbatches before the step, which the dynamic "
                "plan knows only as it claims them (the trainer refuses --odc_plan dynamic)",
            ),
            "odc_packed": "TRL's KTO collator pads each example's row; packing is the DPO trainer's",
        },
    ),
}
# The SFT example on a 2-D mesh (2 replicas x 2 shards, 4 processes): FSDP2's HSDP under the three samplers vs ODC
# inside each shard group with one all-reduce across replicas per step. Same arms, the HSDP config files.
WORKLOADS["sft_hsdp"] = replace(
    WORKLOADS["sft"],
    name="sft_hsdp",
    config_files={"fsdp2_cpu.yaml": "fsdp2_hsdp_cpu.yaml", "odc_cpu.yaml": "odc_hsdp_cpu.yaml"},
)

QUICK = dict(arms=("fsdp2_random", "odc"), repeats=1, max_steps=2, warmup=1, max_length=64, batch=1, grad_accum=2)
"""Defaults of ``--quick``: a tiny run for tests."""
