"""ODC for TRL: the trainers of `odc_accelerate.trainers` and their training arguments (``--odc true`` and friends).

One module per trainer (``sft``, ``dpo``, ...: its class, loss weight and step metrics) and per shared concern:
`configs` (every ``ODC*Config``), `pairs` (DPO's and the reward trainer's preference pairs), `online` and
`online_checks` (GRPO's and RLOO's generation and refusals), `reference` (a reference model on a gather-only engine),
`metrics`, `rollouts` and `unsupported` (the refusal of the trainers ODC does not serve). TRL's internals are in
`odc_accelerate._compat.trl`. Names are imported on first use, so that an SFT run does not import TRL's GRPO trainer.
Usage and what each trainer changes: docs/integrations.md.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ...trainers import SERVED_TRAINERS

#: Public name -> the module of this package that defines it: each trainer's config in `configs`, its trainer in the
#: module of its name.
_LAZY = {"ODCTrainingArgumentsMixin": "configs"}
for _trainer in SERVED_TRAINERS:
    _LAZY[_trainer.odc_config] = "configs"
    _LAZY[_trainer.odc_trainer] = _trainer.name
del _trainer

__all__ = sorted(_LAZY)

if TYPE_CHECKING:  # pragma: no cover  (for type checkers; __all__ is built from _LAZY)
    from .configs import (  # noqa: F401
        ODCDistillationConfig,
        ODCDPOConfig,
        ODCGRPOConfig,
        ODCKTOConfig,
        ODCRewardConfig,
        ODCRLOOConfig,
        ODCSFTConfig,
        ODCTrainingArgumentsMixin,
    )
    from .distillation import ODCDistillationTrainer  # noqa: F401
    from .dpo import ODCDPOTrainer  # noqa: F401
    from .grpo import ODCGRPOTrainer  # noqa: F401
    from .kto import ODCKTOTrainer  # noqa: F401
    from .reward import ODCRewardTrainer  # noqa: F401
    from .rloo import ODCRLOOTrainer  # noqa: F401
    from .sft import ODCSFTTrainer  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
