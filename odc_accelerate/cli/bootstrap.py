"""Run a training script with ODC in place of TRL's trainers: ``python -m odc_accelerate.cli.bootstrap SCRIPT ARGS``.

``odc-accelerate launch`` starts every worker of a run that asks for ODC this way (``accelerate launch --module
odc_accelerate.cli.bootstrap SCRIPT ARGS``; ``-m MODULE ARGS`` runs a module instead of a file). Before the script
runs, as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]`` (`runpy`), each worker:

1. checks the script's ``--config`` recipe for misspelt ``odc*`` keys;
2. installs ODC's accelerate patches (`odc_accelerate.enable`; a script that builds a plain ``Accelerator()`` then
   gets the ODC plugin);
3. replaces ``SFTConfig``, ``SFTTrainer``, ``DPOConfig``, ``DPOTrainer``, ``GRPOConfig``, ``GRPOTrainer``,
   ``RLOOConfig`` and ``RLOOTrainer`` on the ``trl`` and ``trl.trainer`` modules with `ODCSFTConfig`, `ODCSFTTrainer`,
   ... (subclasses of TRL's, with the ODC options as extra arguments): TRL's own ``trl/scripts/sft.py`` then parses
   ``--odc_*`` arguments and recipe keys and trains with ODC, unmodified;
4. makes ``transformers.Trainer.train`` stop, before training, on a trainer that is not an ODC trainer (a custom
   ``Trainer`` subclass, a trainer imported from where TRL defines it, a TRL trainer ODC does not support), with a
   message naming the class and what to change: a run that asks for ODC never trains without it.

Nothing happens on import; `install` does steps 2-4.
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
    "RLOOConfig": "ODCRLOOConfig",
    "RLOOTrainer": "ODCRLOOTrainer",
}

USAGE = "usage: python -m odc_accelerate.cli.bootstrap SCRIPT [ARGS] | -m MODULE [ARGS]"


def require_odc_trainer(trainer: Any) -> None:
    """Raise a `RuntimeError` naming ``trainer``'s class unless it is an ODC trainer (a subclass of
    `odc_accelerate.ODCTrainerMixin`)."""
    import odc_accelerate

    if isinstance(trainer, odc_accelerate.ODCTrainerMixin):
        return
    cls = type(trainer)
    raise RuntimeError(
        f"This run asks for ODC, but the script trains with {cls.__module__}.{cls.__qualname__}, which is not an ODC "
        "trainer: it would train without ODC, so it was stopped before training. Build the trainer from "
        "`from trl import SFTTrainer` / `DPOTrainer` / `GRPOTrainer` / `RLOOTrainer` (replaced by the ODC trainers in "
        "this run) or from `odc_accelerate.ODCSFTTrainer` / `ODCDPOTrainer` / `ODCGRPOTrainer` / `ODCRLOOTrainer`; "
        "for a transformers Trainer subclass, put `odc_accelerate.ODCTrainerMixin` first among its bases "
        f"(`class {cls.__name__}(ODCTrainerMixin, ...)`). To train without ODC, set `odc: false` in the accelerate "
        "config (or ODC_ENABLE=false)."
    )


def install() -> None:
    """Steps 2-4 of the module docstring, in this process."""
    import odc_accelerate

    from .._compat import transformers as transformers_compat
    from .._compat import trl as trl_compat

    odc_accelerate.enable()
    trl_compat.replace_public_classes({name: getattr(odc_accelerate, odc) for name, odc in ODC_CLASSES.items()})
    transformers_compat.guard_trainer_train(require_odc_trainer)


def main(argv: Sequence[str] | None = None) -> None:
    """Check the recipe, `install`, then run the script (or ``-m MODULE``) as ``__main__``."""
    argv = list(sys.argv[1:] if argv is None else argv)
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
    install()
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
