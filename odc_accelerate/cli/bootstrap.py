"""Run a training script with ODC in place of TRL's trainers: ``python -m odc_accelerate.cli.bootstrap SCRIPT ARGS``.

``odc-accelerate launch`` starts every worker of a run that asks for ODC this way (``accelerate launch --module
odc_accelerate.cli.bootstrap SCRIPT ARGS``; ``-m MODULE ARGS`` runs a module instead of a file). Before the script
runs, as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]`` (`runpy`), each worker:

1. checks the script's ``--config`` recipe for misspelt ``odc*`` keys;
2. installs ODC's accelerate patches (`odc_accelerate.enable`; a script that builds a plain ``Accelerator()`` then
   gets the ODC plugin);
3. replaces ``SFTConfig``, ``SFTTrainer``, ``DPOConfig``, ``DPOTrainer``, ``GRPOConfig``, ``GRPOTrainer``,
   ``RewardConfig``, ``RewardTrainer``, ``RLOOConfig``, ``RLOOTrainer``, ``KTOConfig`` and ``KTOTrainer`` on the ``trl`` and ``trl.trainer`` modules
   with `ODCSFTConfig`, `ODCSFTTrainer`, ... (subclasses of TRL's, with the ODC options as extra arguments): TRL's own
   ``trl/scripts/sft.py`` then parses ``--odc_*`` arguments and recipe keys and trains with ODC, unmodified;
4. replaces ``Trainer`` on ``transformers`` and ``transformers.trainer`` with `odc_accelerate.ODCTrainer`: a plain
   ``Trainer`` script, and a ``class MyTrainer(Trainer)`` it defines, train with ODC, unmodified (TRL's trainers and
   transformers' ``Seq2SeqTrainer``, defined before the swap, keep transformers' own base);
5. makes ``transformers.Trainer.train`` stop, before training, on a trainer that is not an ODC trainer ODC can serve
   (a trainer imported from where TRL defines it, a TRL trainer ODC does not support, ``Seq2SeqTrainer``), with a
   message naming the class and what to change: a run that asks for ODC never trains without it. ``DistillationTrainer``
   is refused with the reason (`odc_accelerate.integrations.trl.unsupported`).

Nothing happens on import; `install` does steps 2-5. With ``--no-odc`` before the script (``odc-accelerate launch``
of a run without ODC), step 2 only: the script trains with plain FSDP2 and the library's own trainers, FSDP2 over gloo
on CPU.
"""

from __future__ import annotations

import os
import runpy
import sys
from collections.abc import Sequence
from typing import Any

from ..recipe import read_recipe, recipe_path

__all__ = ["ODC_CLASSES", "install", "main", "require_odc_trainer"]

#: TRL class name -> the top-level `odc_accelerate` name of its ODC replacement.
ODC_CLASSES = {
    "SFTConfig": "ODCSFTConfig",
    "SFTTrainer": "ODCSFTTrainer",
    "DPOConfig": "ODCDPOConfig",
    "DPOTrainer": "ODCDPOTrainer",
    "GRPOConfig": "ODCGRPOConfig",
    "GRPOTrainer": "ODCGRPOTrainer",
    "RewardConfig": "ODCRewardConfig",
    "RewardTrainer": "ODCRewardTrainer",
    "RLOOConfig": "ODCRLOOConfig",
    "RLOOTrainer": "ODCRLOOTrainer",
    "KTOConfig": "ODCKTOConfig",
    "KTOTrainer": "ODCKTOTrainer",
}

USAGE = "usage: python -m odc_accelerate.cli.bootstrap [--no-odc] SCRIPT [ARGS] | [--no-odc] -m MODULE [ARGS]"


def require_odc_trainer(trainer: Any) -> None:
    """Raise a `RuntimeError` naming ``trainer``'s class unless it is an ODC trainer ODC can serve: a subclass of
    `odc_accelerate.ODCTrainerMixin` none of whose classes below ODC's is another library trainer (a transformers or
    TRL trainer class defined on the swapped-in `odc_accelerate.ODCTrainer`, which ODC has not been made for); for a TRL
    trainer ODC refuses (distillation) the message says why."""
    import odc_accelerate
    from odc_accelerate.integrations.trl.unsupported import unsupported_trainer_message

    cls = type(trainer)
    off = "To train without ODC, set `odc: false` in the accelerate config (or ODC_ENABLE=false)."
    if isinstance(trainer, odc_accelerate.ODCTrainerMixin):
        library = _library_trainer_below_odc(cls)
        if library is None:
            return
        raise RuntimeError(
            f"This run asks for ODC, but the script trains with {_name(library)}, a trainer ODC does not support: it "
            f"was stopped before training. {_unsupported_hint(library)}{off}"
        )
    refused = unsupported_trainer_message(trainer)
    if refused is not None:
        raise RuntimeError(refused)
    raise RuntimeError(
        f"This run asks for ODC, but the script trains with {_name(cls)}, which is not an ODC trainer: it would train "
        f"without ODC, so it was stopped before training. {_unsupported_hint(cls)}"
        "Build the trainer from `from transformers import Trainer` or `from trl import SFTTrainer` / `DPOTrainer` / "
        "`GRPOTrainer` / `RewardTrainer` / `RLOOTrainer` / `KTOTrainer` (replaced by the ODC trainers in this run), or from "
        "`odc_accelerate.ODCTrainer` / `ODCSFTTrainer` / `ODCDPOTrainer` / `ODCGRPOTrainer` / `ODCRewardTrainer` / "
        "`ODCRLOOTrainer` / `ODCKTOTrainer`; for a subclass of a transformers Trainer imported from elsewhere, put "
        "`odc_accelerate.ODCTrainerMixin` first among its bases "
        f"(`class {cls.__name__}(ODCTrainerMixin, ...)`). {off}"
    )


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_library_class(cls: type) -> bool:
    return cls.__module__.split(".")[0] in ("transformers", "trl")


def _library_trainer_below_odc(cls: type) -> type | None:
    """The first transformers / TRL class in ``cls``'s MRO before `odc_accelerate.ODCTrainer`, if any: a library
    trainer defined on the swapped-in ``Trainer`` (imported after the bootstrap), which ODC does not serve."""
    import odc_accelerate

    for base in cls.__mro__:
        if base is odc_accelerate.ODCTrainer or issubclass(odc_accelerate.ODCTrainer, base):
            return None
        if _is_library_class(base):
            return base
    return None


def _unsupported_hint(cls: type) -> str:
    """What to use instead of a library trainer ODC does not serve, or ``""`` for a script's own class."""
    seq2seq = [base for base in cls.__mro__ if base.__name__ == "Seq2SeqTrainer" and _is_library_class(base)]
    if seq2seq:
        return (
            "ODC does not support transformers' Seq2SeqTrainer (encoder-decoder training with generation in its "
            "evaluation; ODC plans causal-LM samples by their input length): train a causal LM with "
            "`transformers.Trainer`, or run without ODC. "
        )
    if _is_library_class(cls):
        return (
            f"ODC supports transformers' Trainer and TRL's SFT, DPO, GRPO, reward, RLOO and KTO trainers, not "
            f"{cls.__qualname__}. "
        )
    return ""


def install(odc: bool = True) -> None:
    """Steps 2-5 of the module docstring, in this process (without ``odc``: step 2 only, plain FSDP2)."""
    import odc_accelerate

    if not odc:
        odc_accelerate.enable()
        return

    from .._compat import transformers as transformers_compat
    from .._compat.trl import classes as trl_classes

    odc_accelerate.enable()
    # TRL first: its trainer modules bind transformers' own Trainer as they are imported, here, before the swap.
    trl_classes.replace_public_classes({name: getattr(odc_accelerate, odc) for name, odc in ODC_CLASSES.items()})
    transformers_compat.replace_trainer(odc_accelerate.ODCTrainer)
    transformers_compat.guard_trainer_train(require_odc_trainer)


def main(argv: Sequence[str] | None = None) -> None:
    """Check the recipe, `install`, then run the script (or ``-m MODULE``) as ``__main__``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    odc = argv[:1] != ["--no-odc"]
    if not odc:
        argv = argv[1:]
    module = None
    if argv[:1] in (["-m"], ["--module"]):
        if len(argv) < 2:
            sys.exit(USAGE)
        module, args = argv[1], argv[2:]
    elif argv and not argv[0].startswith("-"):
        script, args = argv[0], argv[1:]
    else:
        sys.exit(USAGE)
    path = recipe_path(args)
    if path is not None:
        read_recipe(path)  # a misspelt odc* key raises here, before any model is built
    install(odc)
    if module is not None:
        sys.argv = [module, *args]  # runpy puts the module's file in argv[0]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        # As `python SCRIPT`: the script's folder first on sys.path, its path in argv[0].
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
