"""Every ODC option on every surface that lists them: the expected list is generated from `ODCConfig`, so an option
added there and missing from a docstring, an example README, a help text or the configuration page fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("trl")

from odc_accelerate.config import option_fields  # noqa: E402
from odc_accelerate.planning import PLANS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FLAGS = [f"--{f.metadata['key']}" for f in option_fields()]
SCRIPTS = ("sft", "dpo", "grpo", "reward", "rloo")


def _missing(text: str, flags: list[str]) -> list[str]:
    # a flag counts when it stands alone (``--odc`` is not found inside ``--odc_plan``)
    return [flag for flag in flags if not re.search(re.escape(flag) + r"(?![\w])", text)]


def _plan_choices_missing(text: str) -> list[str]:
    """The plans not named in the text that follows any one ``--odc_plan`` (its row, parenthesis or help): those of
    the mention that names the most."""
    afters = [text[m.start() : m.start() + 400] for m in re.finditer("--odc_plan", text)]
    return min(([plan for plan in PLANS if plan not in after] for after in afters), key=len, default=list(PLANS))


def test_the_expected_list_is_every_option():
    assert len(FLAGS) == 13 and "--odc" in FLAGS and "--odc_reduction" in FLAGS


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_docstrings_list_every_option(name):
    import importlib

    doc = importlib.import_module(f"odc_accelerate.scripts.{name}").__doc__
    assert _missing(doc, FLAGS) == []
    assert _plan_choices_missing(doc) == []


@pytest.mark.parametrize("name", SCRIPTS)
def test_example_readmes_list_every_option(name):
    text = (ROOT / "examples" / name / "README.md").read_text()
    assert _missing(text, FLAGS) == []
    assert _plan_choices_missing(text) == []


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_help_lists_every_option(name):
    import importlib

    text = importlib.import_module(f"odc_accelerate.scripts.{name}").make_parser().format_help()
    assert _missing(text, FLAGS) == []


def test_config_command_takes_every_option_but_enable():
    from odc_accelerate.cli.config import make_parser

    text = make_parser().format_help()
    assert _missing(text, [flag for flag in FLAGS if flag != "--odc"]) == []
    assert _plan_choices_missing(text) == []


def test_configuration_page_lists_every_key_and_variable():
    text = (ROOT / "docs" / "configuration.md").read_text()
    for f in option_fields():
        assert f"`{f.metadata['key']}`" in text and f"`{f.metadata['env']}`" in text, f.name


def test_readme_layout_names_every_example_and_script():
    readme = (ROOT / "README.md").read_text()
    layout = readme[readme.index("## Layout") :]
    for path in sorted((ROOT / "scripts").glob("*.sh")):
        assert path.name in layout, path.name
    for path in sorted(p for p in (ROOT / "examples").iterdir() if p.is_dir()):
        assert f"{path.name}/" in layout.split("examples/", 1)[1].split("\n")[0], path.name


def test_readme_installs_from_the_clone_first():
    """The package is not on the registry: the first install command of the README is the one that works today."""
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"^pip install (\S+)", readme, re.MULTILINE)
    assert first is not None and first.group(1) == '".[hf,demo]"'
