"""The ODC training arguments of the TRL trainers: one ``ODC<Name>Config`` per row of `odc_accelerate.trainers`.

Each is TRL's config plus one field per `odc_accelerate.config.ODCConfig` option, named by its key (``--odc``,
``--odc_plan``, ...), generated from `ODCConfig` so that each option is defined once. The fields parse from the
command line and from a TRL ``--config recipe.yaml``; `None` means "not set here", and the ``fsdp_config`` keys and
``ODC_*`` environment variables are consulted next (see `ODCConfig.from_sources`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, make_dataclass
from typing import Any

from trl import DistillationConfig, DPOConfig, GRPOConfig, KTOConfig, RewardConfig, RLOOConfig, SFTConfig

from ...config import training_args_fields
from ..accelerate import enable

__all__ = [
    "ODCDistillationConfig",
    "ODCDPOConfig",
    "ODCGRPOConfig",
    "ODCKTOConfig",
    "ODCRewardConfig",
    "ODCRLOOConfig",
    "ODCSFTConfig",
    "ODCTRLConfigMixin",
    "ODCTrainingArgumentsMixin",
]

ODCTrainingArgumentsMixin = make_dataclass("ODCTrainingArgumentsMixin", training_args_fields(), kw_only=False)
ODCTrainingArgumentsMixin.__module__ = __name__
ODCTrainingArgumentsMixin.__doc__ = (
    "ODC fields of the ODC training arguments: one per `odc_accelerate.config.ODCConfig` option, named by its key."
)


def _gpu_bf16_available() -> bool:
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return bool(is_torch_bf16_gpu_available() or is_torch_xla_available())


def _has_accelerator() -> bool:
    """Whether torch sees a GPU or another accelerator (CUDA, ROCm, XPU, MPS, ...) on this machine."""
    import torch

    if torch.cuda.is_available():
        return True
    accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
    return bool(accelerator is not None and accelerator.is_available())


def cpu_precision_defaults(args: Any) -> None:
    """On a machine without a bf16-capable GPU, TRL's default ``bf16=True`` would stop the run ("Your setup doesn't
    support bf16/gpu"): the default becomes fp32 there. An explicit ``--bf16 true`` sets ``use_cpu`` so that bf16
    mixed precision runs on CPU (FSDP2's MixedPrecisionPolicy) only on a machine with no GPU at all: a GPU without
    bf16 stops the run instead, rather than moving it to the CPU. GPU runs with bf16 keep TRL's defaults.

    Raises:
        ValueError: ``--bf16 true`` on a GPU without bf16 support (and without ``--use_cpu true``).
    """
    if _gpu_bf16_available():
        return
    if args.bf16 is None and not args.fp16:
        args.bf16 = False
    elif args.bf16 and not args.use_cpu:
        if _has_accelerator():
            raise ValueError(
                "--bf16 true: this machine's GPU does not support bf16. Pass --bf16 false (fp32) or --fp16 true on the "
                "GPU, or --use_cpu true to train in bf16 on the CPU."
            )
        args.use_cpu = True


def _checkpointing_by_its_current_name(args: Any) -> None:
    """TRL's configs default ``gradient_checkpointing=True``, a name transformers deprecates in favour of
    ``activation_checkpointing``, so every process of every run printed a FutureWarning. Where transformers has the new
    name and it is unset, the setting moves to it first: the same run, without the warning."""
    for old, new in (
        ("gradient_checkpointing", "activation_checkpointing"),
        ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs"),
    ):
        if getattr(args, new, False) is None and getattr(args, old, None) is not None:
            setattr(args, new, getattr(args, old))


@dataclass
class ODCTRLConfigMixin(ODCTrainingArgumentsMixin):
    """The ODC fields plus what every ODC TRL config does first: install ODC's accelerate patches (before the training
    arguments create the process group: FSDP2 on CPU needs gloo) and pick CPU precision defaults."""

    def __post_init__(self) -> None:
        enable()
        cpu_precision_defaults(self)
        _checkpointing_by_its_current_name(self)
        super().__post_init__()


@dataclass
class ODCSFTConfig(ODCTRLConfigMixin, SFTConfig):
    """`trl.SFTConfig` plus the ODC options (``--odc``, ``--odc_plan``, ...; see `odc_accelerate.config.ODCConfig`).

    On a machine without a bf16-capable GPU the precision defaults to fp32; ``--bf16 true`` runs bf16 mixed precision
    on CPU where there is no GPU, and stops with a message on a GPU without bf16. GPU runs keep TRL's defaults.
    """


@dataclass
class ODCDPOConfig(ODCTRLConfigMixin, DPOConfig):
    """`trl.DPOConfig` plus the ODC options (same CPU precision defaults as `ODCSFTConfig`). ``padding_free``, which
    TRL 1.16's own trainer turns off, is served by `ODCDPOTrainer` (docs/integrations.md, "TRL DPO")."""

    padding_free: bool = field(
        default=False,
        metadata={
            "help": "Pack each microbatch's pairs into one row, chosen and rejected each its own sequence, instead of "
            "padding them (TRL 1.16's own DPOTrainer turns this off; ODC's serves it). Where the attention kernel "
            "cannot keep packed sequences apart (an attention implementation other than eager, sdpa, flex_attention "
            "or flash attention, linear-attention layers without their kernels, images, prompt-learning PEFT), the "
            "pairs stay padded and the run says why."
        },
    )


@dataclass
class ODCGRPOConfig(ODCTRLConfigMixin, GRPOConfig):
    """`trl.GRPOConfig` plus the ODC options (same CPU precision defaults as `ODCSFTConfig`)."""


@dataclass
class ODCRewardConfig(ODCTRLConfigMixin, RewardConfig):
    """`trl.RewardConfig` plus the ODC options (same CPU precision defaults as `ODCSFTConfig`)."""


@dataclass
class ODCRLOOConfig(ODCTRLConfigMixin, RLOOConfig):
    """`trl.RLOOConfig` plus the ODC options (same CPU precision defaults as `ODCSFTConfig`)."""


@dataclass
class ODCKTOConfig(ODCTRLConfigMixin, KTOConfig):
    """`trl.KTOConfig` plus the ODC options (same CPU precision defaults as `ODCSFTConfig`)."""


@dataclass
class ODCDistillationConfig(ODCTRLConfigMixin, DistillationConfig):
    """`trl.DistillationConfig` plus the ODC options (same CPU precision defaults as `ODCSFTConfig`)."""
