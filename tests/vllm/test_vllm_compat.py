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


def _moe_model(quant_method):
    import torch

    layer = torch.nn.Module()
    layer.quant_method = quant_method
    model = torch.nn.Module()
    model.experts = layer
    model.shared = layer  # a layer registered under two names is set up once
    return model


def _unquantized(backend):
    import torch
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    method = object.__new__(UnquantizedFusedMoEMethod)  # the attributes the reset reads, without an engine
    torch.nn.Module.__init__(method)  # vLLM's CustomOp is a module
    method.unquantized_backend, method.moe_kernel = backend, object()
    return method


def test_the_cpu_moe_layers_are_the_ones_set_up_again_and_quantized_experts_are_refused():
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod

    from odc_accelerate._compat import CompatError
    from odc_accelerate._compat import vllm as vcompat

    cpu = _unquantized(UnquantizedMoeBackend.CPU)
    assert vcompat._moe_layers_to_set_up_again(_moe_model(cpu)) == [cpu]
    # CUDA's default (Triton) lays the experts out as the checkpoint does: left as vLLM reloads it
    assert vcompat._moe_layers_to_set_up_again(_moe_model(_unquantized(UnquantizedMoeBackend.TRITON))) == []
    with pytest.raises(NotImplementedError, match=r"MoE layer experts serves its experts with Fp8MoEMethod.*without"):
        vcompat._moe_layers_to_set_up_again(_moe_model(object.__new__(Fp8MoEMethod)))
    del cpu.moe_kernel
    with pytest.raises(CompatError, match=r"`vllm\.model_executor\.layers\.fused_moe\..*moe_kernel`"):
        vcompat._moe_layers_to_set_up_again(_moe_model(cpu))
