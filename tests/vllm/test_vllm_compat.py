"""The vLLM internals of the weight sync (`odc_accelerate._compat.vllm`): checked at import, refused with a message
that says what to change."""

import types

import pytest


def test_internals_are_checked_at_import_and_a_missing_one_is_named():
    from odc_accelerate._compat import CompatError
    from odc_accelerate._compat import vllm as vcompat

    vcompat._check_private_functions()  # positive control: the installed vLLM has every internal
    with pytest.raises(CompatError, match=r"vLLM internal `vllm\.LLM\.llm_engine`.*tested with vLLM 0\.32"):
        vcompat.worker_of(types.SimpleNamespace())


def test_an_engine_in_another_process_is_refused_with_the_variable_to_set():
    from odc_accelerate._compat import vllm as vcompat

    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=object()))  # no model_executor
    with pytest.raises(ValueError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        vcompat.worker_of(llm)
    with pytest.raises(ValueError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        vcompat.shutdown_engine(llm)


def test_an_engine_with_several_workers_is_refused():
    from odc_accelerate._compat import vllm as vcompat

    config = types.SimpleNamespace(parallel_config=types.SimpleNamespace(world_size=2))
    llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(model_executor=object(), vllm_config=config))
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        vcompat.worker_of(llm)


def test_wrapper_segments_leave_hugging_face_names():
    from odc_accelerate.integrations.vllm import hf_parameter_name

    name = "model.layers.0._checkpoint_wrapped_module._orig_mod.self_attn.q_proj.weight"
    assert hf_parameter_name(name) == "model.layers.0.self_attn.q_proj.weight"
