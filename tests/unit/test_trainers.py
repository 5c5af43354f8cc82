"""The trainers' rows (`odc_accelerate.trainers`) and what reads them: each served row has its three modules and its
ODC classes, built on TRL's, and every list of trainers in the package (the commands, the bootstrap's swap, TRL's
public classes, the lazy exports, the refusals, the launch hint) is the rows'."""

from __future__ import annotations

import importlib
import inspect

import pytest

pytest.importorskip("trl")

import trl  # noqa: E402

import odc_accelerate  # noqa: E402
from odc_accelerate import trainers  # noqa: E402
from odc_accelerate._compat.trl import classes as trl_classes  # noqa: E402
from odc_accelerate.cli import bootstrap, training  # noqa: E402
from odc_accelerate.integrations import trl as odc_trl  # noqa: E402
from odc_accelerate.integrations.trainer import setup  # noqa: E402
from odc_accelerate.integrations.trl import unsupported  # noqa: E402

SERVED = trainers.SERVED_TRAINERS
IDS = [t.name for t in SERVED]


def test_the_registry_is_a_leaf():
    tree = inspect.getsource(trainers)
    assert "from ." not in tree and "import odc_accelerate" not in tree


def test_names_are_unique_and_no_trainer_is_both_served_and_refused():
    assert len({t.name for t in SERVED}) == len(SERVED)
    assert not {t.trl_trainer for t in SERVED} & {t.trl_trainer for t in trainers.REFUSED_TRAINERS}
    with pytest.raises(AttributeError):
        SERVED[0].name = "other"  # frozen


@pytest.mark.parametrize("row", SERVED, ids=IDS)
def test_each_served_row_has_its_modules_and_classes_built_on_trls(row):
    module = importlib.import_module(row.module)
    trainer, config = getattr(module, row.odc_trainer), getattr(odc_trl, row.odc_config)
    assert trainer.__module__ == row.module and config.__module__ == "odc_accelerate.integrations.trl.configs"
    trl_trainer, trl_config = getattr(trl, row.trl_trainer), getattr(trl, row.trl_config)
    assert issubclass(trainer, trl_trainer) and issubclass(config, trl_config)
    assert f"{trl_trainer.__module__}.{trl_trainer.__qualname__}" == row.trl_path
    assert getattr(odc_accelerate, row.odc_trainer) is trainer and getattr(odc_accelerate, row.odc_config) is config
    assert callable(importlib.import_module(row.script).make_parser)
    importlib.import_module(f"odc_accelerate._compat.trl.{row.name}")


def test_the_lists_of_trainers_are_the_rows():
    pairs = {(t.trl_config, t.odc_config) for t in SERVED} | {(t.trl_trainer, t.odc_trainer) for t in SERVED}
    assert set(bootstrap.ODC_CLASSES.items()) == pairs
    assert set(trl_classes.PUBLIC_CLASSES) == {trl_name for trl_name, _ in pairs}
    assert training.COMMANDS == tuple(IDS)
    odc_names = {odc_name for _, odc_name in pairs}
    assert odc_names | {"ODCTrainingArgumentsMixin"} == set(odc_trl.__all__)
    assert odc_names <= set(odc_accelerate.__all__)
    assert odc_accelerate.__all__ == sorted(odc_accelerate.__all__) and odc_trl.__all__ == sorted(odc_trl.__all__)
    assert unsupported.SERVED_TRAINERS == {t.trl_path: t.odc_trainer for t in SERVED}
    assert set(unsupported.UNSUPPORTED_TRAINERS) == {t.trl_trainer for t in trainers.REFUSED_TRAINERS}
    assert f"odc-accelerate {'|'.join(IDS)} " in setup.LAUNCH_HINT


def test_the_commands_are_the_rows():
    parser = importlib.import_module("odc_accelerate.cli.main").make_parser()
    (commands,) = [action for action in parser._actions if action.dest == "command"]
    assert list(commands.choices) == ["launch", "config", *IDS]
    help_text = parser.format_help()
    for row in SERVED:
        assert f"{row.help} with ODC (TRL's `trl {row.name}` arguments" in " ".join(help_text.split())


def test_served_list_reads_as_a_sentence():
    assert trainers.served_list("name") == ", ".join(IDS[:-1]) + f" and {IDS[-1]}"
    assert trainers.served_list("odc_trainer", quote="`", last="or").endswith(f"or `{SERVED[-1].odc_trainer}`")
