"""No private internal of torch, transformers, accelerate, datasets, TRL, vLLM or PEFT is used outside `_compat`.

Every such internal lives in one module per library under ``odc_accelerate/_compat/``, behind a check that fails
naming what is missing. `find_private_uses` walks the syntax tree of a source file and reports each use of one
elsewhere; `test_no_library_internal_is_used_outside_the_compat_modules` runs it over every ``.py`` file of the
repository (the package, the tests and their helpers, the examples, the benchmarks, the scripts), including the
Python scripts that tests keep in strings and run in a subprocess.

A use is:

* an import of a private module or name of one of the libraries: ``import torch._C``,
  ``from torch.distributed.fsdp._fully_shard import fully_shard``, ``from transformers.trainer import _is_peft_model``;
* a private attribute of something bound from one of them, however it was imported or aliased:
  ``torch.distributed._functional_collectives``, ``dist._foo`` after ``import torch.distributed as dist``, and the
  same by name (``getattr(torch, "_C")``, ``vars(cls)["_x"]``, ``importlib.import_module("torch._dynamo")``);
* a name that ``_compat`` reads as a private attribute of a library object (`compat_private_names`:
  ``_get_fsdp_state``, ``_metrics``, ``_WORLD``...), read, written or looked up by name on any object, since the type
  of an arbitrary object (``module._fsdp_param_group``) cannot be known from the source.

Not uses: dunders (``__version__``), the project's own private names (``odc_accelerate._compat``,
``odc_accelerate.transport.cuda.kernels._kernel``, an attribute of a class imported from the project), other
libraries' private names (``sys._getframe``, ``_pytest``), and an override calling the library method it overrides
(``super()._generate(...)`` inside ``def _generate``): the overridden methods and their parameters are checked by
``_compat`` (``_compat.transformers.check``, ``_compat.trl.grpo.check_grpo``).
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
THIS_FILE = Path(__file__).resolve().relative_to(ROOT)
PROJECT = "odc_accelerate"
COMPAT_DIR = Path(PROJECT, "_compat")
SCANNED_DIRS = (PROJECT, "tests", "examples", "benchmarks", "scripts")
LIBRARIES = frozenset({"torch", "transformers", "accelerate", "datasets", "trl", "vllm", "peft"})

#: Private names that ``_compat`` reads but that belong to no library above (with why they are there).
NOT_LIBRARY_NAMES = {
    "_actions": "argparse.ArgumentParser's, read on accelerate's launch parser (and on the project's own parsers)",
}
#: The prefix of the project's own attributes set on library objects (``_odc_patch``, ``_odc_skips_itself``).
PROJECT_ATTRIBUTE_PREFIX = "_odc"
#: Private names of the libraries that ``_compat`` does not read (yet), known all the same.
MORE_LIBRARY_NAMES = {
    "_attn_implementation": "transformers' config attribute behind the public ``attn_implementation``",
}
#: Modules with public names that are internal to their library: the package imports them only in ``_compat``.
INTERNAL_MODULES = {"accelerate.commands": "accelerate's command-line tool, not its library API"}


@dataclass(frozen=True)
class Allowed:
    """Uses outside ``_compat`` that stay: in ``path``, the ``expressions`` (as reported), for ``reason``."""

    path: str
    reason: str
    expressions: tuple[str, ...]


#: Each checks a ``_compat`` module against the internal itself, or stands in for it: a test cannot reach the internal
#: through the module it checks.
ALLOWED = (
    Allowed(
        "tests/unit/test_online_steps.py",
        "calls the online mixin's override of GRPOTrainer's sampler hook, to compare its prompts with TRL's",
        ("trainer._get_train_sampler",),
    ),
    Allowed(
        "tests/unit/test_dpo_packing.py",
        "plants an attention implementation transformers' setter would normalise away, to see packing refuse it",
        ("eager.config._attn_implementation",),
    ),
    Allowed(
        "tests/unit/test_compat.py",
        "plants a torch whose private function renamed a parameter, to see `_compat.torch.fsdp` refuse it",
        (
            "import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives",
            "collectives._get_gradient_divide_factors",
        ),
    ),
    Allowed(
        "tests/unit/test_compat.py",
        "sees that `_compat.accelerate.install` wraps accelerate's originals, and `uninstall` puts them back",
        ("PartialState.__dict__['_prepare_backend']", "fsdp_utils._find_final_norm"),
    ),
    Allowed(
        "tests/unit/test_vlm.py",
        "checks `_compat.accelerate`'s wrap of the final-norm search accelerate's FSDP2 preparation calls, on a VLM",
        ("fsdp_utils._find_final_norm",),
    ),
    Allowed(
        "tests/unit/test_compat.py",
        "checks `_compat.torch.PATHS` against the installed torch's own source",
        (
            "from torch.distributed.fsdp._fully_shard import "
            "_fsdp_common, _fsdp_param, _fsdp_param_group, _fsdp_state",
            "_fsdp_param_group.FSDPParamGroup._init_mp_dtypes",
        ),
    ),
    Allowed(
        "tests/unit/test_transport_cuda_logic.py",
        "checks `_compat.torch.symm_mem.symmetric_signal_pad_bytes` against torch's own figure",
        ("import torch.distributed._symmetric_memory as symm",),
    ),
    Allowed(
        "tests/unit/test_compat_trl.py",
        "stands a kernel in for the TRL one `_compat.trl.lm_head.fused_lm_head_torch_path` routes around, and sees it back",
        (
            "monkeypatch.setattr(trl_utils, '_ChunkedLogProbFunction', _CudaOnlyKernel)",
            "trl_utils._ChunkedLogProbFunction",
        ),
    ),
    Allowed(
        "tests/unit/test_compat_trl.py",
        "a stand-in for TRL's VLLMGeneration carries the flag `_compat.trl.grpo.wake_vllm_weights` clears",
        ("self._llm_weights_sleeping", "generation._llm_weights_sleeping"),
    ),
    Allowed(
        "tests/unit/test_reward.py",
        "a stand-in for TRL's RewardTrainer carries the metrics and token count `_compat.trl` reads and rewrites",
        ("self._metrics", "self._total_train_tokens"),
    ),
    Allowed(
        "tests/unit/test_kto.py",
        "a stand-in for TRL's KTOTrainer carries the metrics and token count `_compat.trl` reads and rewrites",
        ("self._metrics", "self._total_train_tokens"),
    ),
    Allowed(
        "tests/unit/test_distillation.py",
        "a stand-in for TRL's DistillationTrainer carries the metrics `_compat.trl.train_metrics` reads",
        ("self._metrics",),
    ),
    Allowed(
        "tests/unit/test_grpo.py",
        "a stand-in for TRL's GRPOTrainer carries the metrics `_compat.trl.train_metrics` reads",
        ("trainer._metrics",),
    ),
    Allowed(
        "tests/unit/test_rloo.py",
        "a stand-in for TRL's RLOOTrainer carries the metrics `_compat.trl.train_metrics` reads",
        ("trainer._metrics",),
    ),
)


@dataclass(frozen=True)
class PrivateUse:
    """One use of a library's private name: where, and the expression (or statement) as the source spells it."""

    line: int
    expression: str


def is_private(name: str) -> bool:
    """Whether a name segment is private: a leading underscore, and not a dunder (``__init__``, ``__version__``)."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__") and len(name) > 4)


def _top(dotted: str) -> str:
    return dotted.split(".", 1)[0]


def _is_library_path(dotted: str | None) -> bool:
    return dotted is not None and _top(dotted) in LIBRARIES


def _private_string(node: ast.AST | None) -> str | None:
    """The value of a string constant that is a private identifier, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.isidentifier():
        return node.value if is_private(node.value) else None
    return None


def _call_name(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


# Calls that look an attribute up by name: ``f(obj, "_name", ...)`` (``monkeypatch.setattr``, ``patch.object``).
_BY_NAME_CALLS = frozenset({"getattr", "hasattr", "setattr", "delattr", "getattr_static", "object"})
_IMPORT_CALLS = frozenset({"import_module", "__import__"})


class _Finder(ast.NodeVisitor):
    """Collects the `PrivateUse` of one parsed source (see the module docstring for what counts)."""

    def __init__(self, known: frozenset[str], line_offset: int = 0, internal: tuple[str, ...] = ()) -> None:
        self.known = known
        self.internal = internal
        self.line_offset = line_offset
        self.bound: dict[str, str] = {}  # local name -> the dotted path it was imported (or aliased) from
        self.functions: list[str] = []
        self.uses: list[PrivateUse] = []

    # ------------------------------------------------------------------------------------------- names and paths
    def bind(self, tree: ast.AST) -> None:
        """Record every import binding of ``tree``, then the plain aliases of those (``dist = torch.distributed``).

        One table for the whole file: a test imports inside its functions, and a name is rarely reused for another
        module."""
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.asname:
                        self.bound[alias.asname] = alias.name
                    else:
                        self.bound[_top(alias.name)] = _top(alias.name)
            elif isinstance(node, ast.ImportFrom):
                module = f"{PROJECT}.{node.module or ''}" if node.level else node.module  # relative: the project's
                for alias in node.names:
                    self.bound[alias.asname or alias.name] = f"{module}.{alias.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                path = self.resolve(node.value)
                if path is not None:
                    self.bound.setdefault(node.targets[0].id, path)

    def resolve(self, node: ast.AST) -> str | None:
        """The dotted path ``node`` names (``dist.group``: ``torch.distributed.group``), if it starts at an import."""
        if isinstance(node, ast.Name):
            return self.bound.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.resolve(node.value)
            return None if base is None else f"{base}.{node.attr}"
        if isinstance(node, ast.Call) and _call_name(node) in _IMPORT_CALLS and node.args:
            arg = node.args[0]
            return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
        return None

    def _is_project(self, node: ast.AST) -> bool:
        path = self.resolve(node)
        return path is not None and _top(path) == PROJECT

    # ------------------------------------------------------------------------------------------- what counts
    def _named_private(self, owner: ast.AST, name: str) -> bool:
        """Whether the private ``name``, read on ``owner``, is a library's."""
        if _is_library_path(self.resolve(owner)):
            return True
        return name in self.known and not self._is_project(owner)

    def _is_override_passthrough(self, node: ast.Attribute) -> bool:
        call = node.value
        return (
            isinstance(call, ast.Call)
            and isinstance(call.func, ast.Name)
            and call.func.id == "super"
            and bool(self.functions)
            and self.functions[-1] == node.attr
        )

    def _attribute_is_use(self, node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and is_private(node.attr)
            and not self._is_override_passthrough(node)
            and self._named_private(node.value, node.attr)
        )

    def report(self, node: ast.AST, expression: str | None = None) -> None:
        line = getattr(node, "lineno", 0) + self.line_offset
        self.uses.append(PrivateUse(line, expression or ast.unparse(node)))

    # ------------------------------------------------------------------------------------------- visitors
    def _is_private_module(self, dotted: str) -> bool:
        if not _is_library_path(dotted):
            return False
        internal = any(dotted == m or dotted.startswith(f"{m}.") for m in self.internal)
        return internal or any(is_private(part) for part in dotted.split("."))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if self._is_private_module(alias.name):
                self.report(node, ast.unparse(ast.Import(names=[alias])))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level or not node.module:
            return
        names = [f"{node.module}.{alias.name}" for alias in node.names]
        if self._is_private_module(node.module) or any(self._is_private_module(name) for name in names):
            self.report(node)

    def _visit_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_FunctionDef = _visit_function
    visit_AsyncFunctionDef = _visit_function

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if self._attribute_is_use(node):
            inner, reported_inside = node.value, False
            while isinstance(inner, ast.Attribute):  # torch._C._x: one use, the first private step
                reported_inside = reported_inside or self._attribute_is_use(inner)
                inner = inner.value
            if not reported_inside:
                self.report(node)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        name = _call_name(node)
        if name in _BY_NAME_CALLS and len(node.args) >= 2:
            attr = _private_string(node.args[1])
            if attr is not None and self._named_private(node.args[0], attr):
                self.report(node)
        elif name in _IMPORT_CALLS and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and _is_library_path(arg.value):
                if any(is_private(part) for part in arg.value.split(".")):
                    self.report(node)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        # cls.__dict__["_name"] and vars(cls)["_name"]
        attr, owner = _private_string(node.slice), None
        if isinstance(node.value, ast.Attribute) and node.value.attr == "__dict__":
            owner = node.value.value
        elif isinstance(node.value, ast.Call) and _call_name(node.value) == "vars" and node.value.args:
            owner = node.value.args[0]
        if attr is not None and owner is not None and self._named_private(owner, attr):
            self.report(node)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        # A script a test runs in a subprocess (``python -c``) is code of the repository too.
        if not (isinstance(node.value, str) and "import " in node.value):
            return
        try:
            script = ast.parse(node.value)
        except SyntaxError:
            return
        if any(isinstance(n, (ast.Import, ast.ImportFrom)) for n in ast.walk(script)):
            offset = self.line_offset + node.lineno - 1
            self.uses += find_private_uses(script, self.known, line_offset=offset, internal_modules=self.internal)


def find_private_uses(
    source: str | ast.AST, known: Iterable[str] = (), *, line_offset: int = 0, internal_modules: Iterable[str] = ()
) -> list[PrivateUse]:
    """Every use of a private name of torch, transformers, accelerate, datasets, TRL, vLLM or PEFT in ``source``.

    Args:
        source (`str` or `ast.AST`): Python source, or its parsed tree.
        known (`Iterable[str]`): private attribute names that are the libraries' whatever object they are read on
            (`compat_private_names`).
        line_offset (`int`, *optional*, defaults to 0): added to every line number (a script inside a file).
        internal_modules (`Iterable[str]`, *optional*): modules whose import counts as a use although their names
            are public (`INTERNAL_MODULES`).

    Returns:
        `list[PrivateUse]`: in source order.
    """
    tree = ast.parse(source) if isinstance(source, str) else source
    finder = _Finder(frozenset(known), line_offset, tuple(internal_modules))
    finder.bind(tree)
    finder.visit(tree)
    return sorted(finder.uses, key=lambda use: use.line)


def compat_private_names(sources: Iterable[str]) -> frozenset[str]:
    """The private names the ``_compat`` modules (``sources``) read on library objects.

    Every private attribute they read (``state._is_root``) and every private identifier they spell as a string
    (``require(module, "_get_fsdp_state", ...)``, ``("_metrics", "_total_train_tokens")``) is a library's internal,
    except the project's own marks (`PROJECT_ATTRIBUTE_PREFIX`) and `NOT_LIBRARY_NAMES`; `MORE_LIBRARY_NAMES` are
    added.
    """
    names: set[str] = set()
    for source in sources:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Attribute) and is_private(node.attr):
                names.add(node.attr)
            elif (name := _private_string(node)) is not None:
                names.add(name)
    names = {n for n in names if not n.startswith(PROJECT_ATTRIBUTE_PREFIX) and n not in NOT_LIBRARY_NAMES}
    return frozenset(names | set(MORE_LIBRARY_NAMES))


def python_files(root: Path) -> Iterator[Path]:
    """The ``.py`` files of `SCANNED_DIRS` under ``root``, relative to it."""
    for folder in SCANNED_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            yield path.relative_to(root)


def scan(root: Path, exclude: Iterable[Path] = ()) -> tuple[list[str], frozenset[str]]:
    """Every use outside ``_compat`` of a library's private name in the repository at ``root``, as
    ``"path:line: expression"``; and the names `compat_private_names` derived from its ``_compat`` modules.

    Args:
        root (`Path`): the repository.
        exclude (`Iterable[Path]`, *optional*): files (relative to ``root``) whose uses are not reported.
    """
    skipped = set(exclude)
    files = list(python_files(root))
    compat = [path for path in files if path.is_relative_to(COMPAT_DIR)]
    known = compat_private_names((root / path).read_text() for path in compat)
    found = []
    for path in files:
        if path.is_relative_to(COMPAT_DIR) or path in skipped:
            continue
        internal = INTERNAL_MODULES if path.is_relative_to(PROJECT) else ()  # the package's code only
        for use in find_private_uses((root / path).read_text(), known, internal_modules=internal):
            found.append(f"{path.as_posix()}:{use.line}: {use.expression}")
    return found, known


def _allowed_key(entry: str) -> tuple[str, str]:
    path, _, rest = entry.partition(":")
    return path, rest.partition(": ")[2]


_ALLOWED_KEYS = {(allowed.path, expression) for allowed in ALLOWED for expression in allowed.expressions}


# --------------------------------------------------------------------------------------------------- the repository
def test_no_library_internal_is_used_outside_the_compat_modules():
    found, known = scan(ROOT, exclude=[THIS_FILE])  # this file's sources are the walker's test cases
    assert {"_get_fsdp_state", "_metrics"} <= known  # derived from _compat (a positive control)
    violations = [entry for entry in found if _allowed_key(entry) not in _ALLOWED_KEYS]
    assert not violations, (
        "library internals used outside odc_accelerate/_compat/ (move each into the library's _compat module, "
        "behind a checked function):\n" + "\n".join(violations)
    )
    unused = _ALLOWED_KEYS - {_allowed_key(entry) for entry in found}
    assert not unused, f"allow-list entries that match no use any more: {sorted(unused)}"


# --------------------------------------------------------------------------------------------------- the walker
def _uses(source: str, known: Iterable[str] = ()) -> list[tuple[int, str]]:
    return [(use.line, use.expression) for use in find_private_uses(textwrap.dedent(source), known)]


def test_walker_finds_private_imports():
    assert _uses("import torch._C") == [(1, "import torch._C")]
    assert _uses("import os, torch._dynamo as dynamo") == [(1, "import torch._dynamo as dynamo")]
    assert _uses("from torch.distributed.fsdp._fully_shard import fully_shard") == [
        (1, "from torch.distributed.fsdp._fully_shard import fully_shard")
    ]
    assert _uses("from transformers.trainer import _is_peft_model") == [
        (1, "from transformers.trainer import _is_peft_model")
    ]
    assert _uses("from torch.distributed import _functional_collectives as fc") != []
    assert _uses("import importlib\nimportlib.import_module('torch._dynamo')") == [
        (2, "importlib.import_module('torch._dynamo')")
    ]
    internal = "import accelerate.commands.launch\nfrom accelerate.commands import config\nimport accelerate.utils"
    assert find_private_uses(internal) == []  # public names...
    assert [u.line for u in find_private_uses(internal, internal_modules=INTERNAL_MODULES)] == [1, 2]  # ...internal


def test_walker_follows_imports_and_aliases_to_private_attributes():
    source = """
        import torch
        import torch.distributed as dist
        from torch import distributed
        from peft import tuners
        world = torch.distributed

        def f(group):
            torch.distributed._functional_collectives.all_reduce(group)
            torch._C._cuda_getDevice()
            dist._foo()
            distributed._bar
            tuners._baz = 1
            world._qux
            return getattr(torch, "_dynamo"), vars(torch.nn.Module)["_apply"]
    """
    assert _uses(source) == [
        (9, "torch.distributed._functional_collectives"),
        (10, "torch._C"),  # one use per chain: its first private step
        (11, "dist._foo"),
        (12, "distributed._bar"),
        (13, "tuners._baz"),
        (14, "world._qux"),
        (15, "getattr(torch, '_dynamo')"),
        (15, "vars(torch.nn.Module)['_apply']"),
    ]


def test_walker_flags_known_library_names_on_any_object():
    source = """
        def f(module, trainer, cls):
            state = module._get_fsdp_state()
            group = state._fsdp_param_group
            trainer._metrics = {}
            return getattr(module, "_fsdp_param_group", None), cls.__dict__["_metrics"]

        class Fake:
            def __init__(self):
                self._fsdp_param_group = None
    """
    known = {"_get_fsdp_state", "_fsdp_param_group", "_metrics"}
    assert _uses(source, known) == [
        (3, "module._get_fsdp_state"),
        (4, "state._fsdp_param_group"),
        (5, "trainer._metrics"),
        (6, "getattr(module, '_fsdp_param_group', None)"),
        (6, "cls.__dict__['_metrics']"),
        (10, "self._fsdp_param_group"),
    ]
    assert _uses(source) == []  # the same names are not known: an arbitrary object's attributes


def test_walker_reads_scripts_kept_in_strings():
    source = '''
        import subprocess, sys

        SCRIPT = """
        import torch
        print(torch._C)
        """
        subprocess.run([sys.executable, "-c", SCRIPT])
    '''
    assert _uses(source) == [(6, "torch._C")]


def test_walker_leaves_dunders_the_projects_names_and_other_libraries_alone():
    source = """
        import os, sys
        import torch
        import odc_accelerate.transport.cuda.kernels
        from _pytest.monkeypatch import MonkeyPatch
        from odc_accelerate._compat.torch import fsdp
        from odc_accelerate.engine import _private_helper
        from odc_accelerate.integrations.trainer.setup import ODCAcceleratorSetup
        from .sibling import _local

        class Mixin:
            def _generate(self, prompts):
                return super()._generate(prompts)  # an override calling what it overrides

        def f(module, t):
            torch.__version__, torch.nn.Module.__init__, sys._getframe(), os._exit
            module._own_attribute, fsdp._record_reduce_params, odc_accelerate.transport.cuda.kernels._kernel
            ODCAcceleratorSetup._build_accelerator_args(t)  # the project's own override
            torch.distributed  # public
    """
    assert _uses(source, {"_generate", "_build_accelerator_args"}) == []
    # super()._generate outside an override of the same name is a use
    assert _uses("class M:\n    def g(self):\n        super()._generate()", {"_generate"}) == [
        (3, "super()._generate")
    ]


def test_compat_names_are_what_compat_reads_on_library_objects():
    compat = """
        from . import require
        def check(state, parser):
            require(state, "_fsdp_param_groups", library="torch", where="FSDPState")
            wrapper._odc_patch = object()
            return state._is_root, parser._actions, state.__class__, _local_helper()
    """
    assert compat_private_names([textwrap.dedent(compat)]) == {"_fsdp_param_groups", "_is_root", *MORE_LIBRARY_NAMES}


def test_repository_scan_fails_on_a_planted_use(tmp_path):
    compat = tmp_path / COMPAT_DIR
    compat.mkdir(parents=True)
    (compat / "torch_like.py").write_text("def read(group):\n    return group._secret_state\n")
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_planted.py").write_text("import torch._C\n\ndef test(group):\n    assert group._secret_state\n")
    found, known = scan(tmp_path)
    assert "_secret_state" in known
    assert found == ["tests/test_planted.py:1: import torch._C", "tests/test_planted.py:4: group._secret_state"]
