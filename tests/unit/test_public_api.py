"""Every name a public module lists in ``__all__`` imports, and the classes and functions among them are the
project's own (defined in a module of `odc_accelerate`, not re-exported from a library)."""

import importlib
import inspect
import types

import pytest

#: The package, its lazily loaded subpackages (the offline demo assets among them) and the integrations: what users
#: import names from.
PUBLIC_MODULES = [
    "odc_accelerate",
    "odc_accelerate.demo",
    "odc_accelerate.engine",
    "odc_accelerate.integrations.accelerate",
    "odc_accelerate.integrations.peft",
    "odc_accelerate.integrations.trainer",
    "odc_accelerate.integrations.trl",
    "odc_accelerate.integrations.vllm",
    "odc_accelerate.planning",
    "odc_accelerate.transport",
]


def _defined_in(obj: object) -> str | None:
    """The module that defines ``obj`` where it is a class or function; None for data (constants, type aliases)."""
    if isinstance(obj, types.GenericAlias) or not (inspect.isclass(obj) or inspect.isfunction(obj)):
        return None
    return obj.__module__


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_every_name_in_all_imports_and_is_defined_in_the_package(module_name):
    module = importlib.import_module(module_name)
    names = module.__all__
    assert names, f"{module_name}.__all__ is empty"
    assert len(set(names)) == len(names), f"{module_name}.__all__ lists a name twice"
    for name in names:
        obj = getattr(module, name)  # lazy names resolve here: a stale entry raises AttributeError / ImportError
        assert not isinstance(obj, types.ModuleType), f"{module_name}.{name} is a module, not an API object"
        where = _defined_in(obj)
        assert where is None or where == "odc_accelerate" or where.startswith("odc_accelerate."), (
            f"{module_name}.{name} is defined in {where}, outside odc_accelerate"
        )


def test_the_engine_names_are_the_ones_their_modules_define():
    """``from odc_accelerate import ODCEngine``, ``from odc_accelerate.engine import ...`` and the defining modules give
    the same objects (no stale copy)."""
    import odc_accelerate
    from odc_accelerate.engine import EngineState, ODCEngine, StepStats, engine, stats

    assert odc_accelerate.ODCEngine is ODCEngine is engine.ODCEngine
    assert (EngineState, StepStats) == (stats.EngineState, stats.StepStats)
    assert (ODCEngine.__module__, StepStats.__module__) == (
        "odc_accelerate.engine.engine",
        "odc_accelerate.engine.stats",
    )


def test_unknown_names_raise_attribute_error():
    import odc_accelerate
    import odc_accelerate.engine

    for module in (odc_accelerate, odc_accelerate.engine):
        with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
            module.nonexistent  # noqa: B018
