"""ODC for TRL: `ODCSFTConfig` (``--odc true`` and friends) and `ODCSFTTrainer`.

```python
from odc_accelerate.integrations.trl import ODCSFTConfig, ODCSFTTrainer

args = ODCSFTConfig(output_dir="out", odc=True, odc_max_tokens_per_microbatch=4096)
trainer = ODCSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
trainer.train()
trainer.end()  # closes the ODC engine and destroys the process group
```

The same fields parse from the command line (``--odc true --odc_balance lockstep``) and from a TRL
``--config recipe.yaml``; an ``odc`` section in ``--fsdp_config file.json`` works too (see
`odc_accelerate.integrations.trainer.resolve_odc_options`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trl import SFTConfig, SFTTrainer

from .. import _trl_compat
from .trainer import ODCTrainerMixin

__all__ = ["ODCSFTConfig", "ODCSFTTrainer", "ODCConfigMixin"]


@dataclass
class ODCConfigMixin:
    """ODC fields for TRL/transformers training arguments. `None` means "not set here" (the ``fsdp_config`` section
    and ``ODC_*`` environment variables are consulted next)."""

    odc: bool | None = field(
        default=None, metadata={"help": "Run FSDP2 with On-Demand Communication (ODC). Needs an FSDP2 launch."}
    )
    odc_max_tokens_per_microbatch: int | None = field(
        default=None,
        metadata={"help": "Token budget of one microbatch for the length-balanced sampler (default: max_length)."},
    )
    odc_balance: str | None = field(
        default=None,
        metadata={
            "help": "Step planning: 'odc' (balanced per-rank totals, free microbatch counts) or 'lockstep' (equal "
            "counts). Setting it without --odc runs plain FSDP2 on the same balanced microbatches.",
            "choices": ["odc", "lockstep"],
        },
    )
    odc_transport: str | None = field(
        default=None, metadata={"help": "ODC transport: auto, shm, network, hierarchical or cuda (default auto)."}
    )
    odc_timeout: float | None = field(
        default=None, metadata={"help": "Seconds an ODC wait may last before naming the missing rank (default 600)."}
    )
    odc_samples_per_step: int | None = field(
        default=None,
        metadata={
            "help": "Samples per optimizer step over all ranks (default per_device_train_batch_size x "
            "gradient_accumulation_steps x world size)."
        },
    )


@dataclass
class ODCSFTConfig(ODCConfigMixin, SFTConfig):
    """`trl.SFTConfig` plus the ODC fields of `ODCConfigMixin`.

    On a machine without a bf16-capable GPU, TRL's default ``bf16=True`` would stop the run ("Your setup doesn't
    support bf16/gpu"); here the default becomes fp32 there, and an explicit ``--bf16 true`` sets ``use_cpu`` so that
    bf16 mixed precision runs on CPU (FSDP2's MixedPrecisionPolicy). GPU runs keep TRL's defaults.
    """

    def __post_init__(self) -> None:
        if not _gpu_bf16_available():
            if self.bf16 is None and not self.fp16:
                self.bf16 = False
            elif self.bf16:
                self.use_cpu = True
        super().__post_init__()


def _gpu_bf16_available() -> bool:
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    return bool(is_torch_bf16_gpu_available() or is_torch_xla_available())


class ODCSFTTrainer(ODCTrainerMixin, SFTTrainer):
    """`trl.SFTTrainer` with ODC: unequal microbatch counts per rank, exact token-mean loss, no collective inside a
    step (TRL's per-microbatch metric gathers are reduced once per step), per-step ODC metrics in the logs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _trl_compat.check_sft(self)

    def _odc_finalize_metrics(
        self, local_sums: list[float], global_sums: list[float], local_microbatches: int, global_microbatches: int
    ) -> None:
        _trl_compat.finalize_sft_metrics(self, local_sums, global_sums, local_microbatches)
