"""The TRL compat paths chosen by the installed TRL version: the fused LM head's torch path (TRL before 1.16)."""

from __future__ import annotations

import pytest
import torch

from odc_accelerate._compat import CompatError
from odc_accelerate._compat.trl import grpo as trl_grpo
from odc_accelerate._compat.trl import lm_head as trl_lm_head


class _CudaOnlyKernel:
    """Stands in for TRL 1.15's ``_ChunkedLogProbFunction``: its Triton kernel fails on CPU tensors."""

    calls = 0

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs
    ):
        raise NotImplementedError

    @classmethod
    def apply(cls, *args):
        cls.calls += 1
        raise RuntimeError("0 active drivers ([]). There should only be one.")


def _tiny_model():
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    sizes = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    config = Qwen2Config(vocab_size=96, **sizes)
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize(
    ("trainer", "module_name"), [("sft", "sft_trainer"), ("dpo", "dpo_trainer"), ("grpo", "grpo_trainer")]
)
@pytest.mark.parametrize("version", ["1.15.0", "1.16.0"])
def test_fused_lm_head_path_is_chosen_by_the_trl_version(monkeypatch, trainer, module_name, version):
    import importlib

    import trl
    from trl.trainer import utils as trl_utils

    module = importlib.import_module(f"trl.trainer.{module_name}")
    monkeypatch.setattr(trl, "__version__", version)
    monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", _CudaOnlyKernel)
    _CudaOnlyKernel.calls = 0
    add_fused_lm_head = module.add_fused_lm_head
    torch_path = version == "1.15.0"
    assert trl_lm_head.needs_torch_lm_head() is torch_path

    model = _tiny_model()
    with trl_lm_head.fused_lm_head_torch_path(trainer):
        assert (module.add_fused_lm_head is not add_fused_lm_head) is torch_path  # TRL 1.16: nothing patched
        module.add_fused_lm_head(
            model, outputs=("log_probs", "entropy", "is_top1")
        )  # what the trainer's __init__ does
    assert module.add_fused_lm_head is add_fused_lm_head

    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :4] = -100
    if not torch_path:  # the installed TRL's own path runs: the stand-in kernel fails, as TRL 1.15's does on CPU
        with pytest.raises(RuntimeError, match="active drivers"):
            model(input_ids=ids, labels=labels, fused_lm_head=True)
        return
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    assert _CudaOnlyKernel.calls == 0 and trl_utils._ChunkedLogProbFunction is _CudaOnlyKernel  # restored after
    with torch.no_grad():
        log_p = torch.log_softmax(model(input_ids=ids).logits.double()[:, :-1], dim=-1)
    shifted = labels[:, 1:]
    mask = shifted != -100
    want = log_p.gather(-1, shifted.clamp(min=0)[..., None])[..., 0] * mask
    torch.testing.assert_close(out.log_probs.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.label_mask, mask)
    out.loss.backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    assert model(input_ids=ids).logits.shape == (2, 9, 96)  # an unfused call is the model's own forward


def test_fused_lm_head_path_names_the_trainers():
    with pytest.raises(ValueError, match="'dpo', 'grpo', 'kto', 'sft'"):
        with trl_lm_head.fused_lm_head_torch_path("ppo"):
            pass


class _FakeLLM:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up {tags}")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


class _FakeVLLMGeneration:
    """Stands in for TRL's ``VLLMGeneration`` in colocate mode (the real one needs vLLM to be built)."""

    def __init__(self, sleep: bool) -> None:
        self.llm = _FakeLLM()
        self.mode = "colocate"
        self.enable_sleep_mode = sleep
        self._llm_weights_sleeping = sleep
        self.trl_syncs = 0

    def sync_weights(self):
        self.trl_syncs += 1

    def generate(self, prompts, images, num_generations, profiler=None):
        self.sync_weights()  # as TRL's does when sleep mode discarded the weights
        return prompts, [[1]] * len(prompts), None, None


def test_trls_vllm_generation_has_what_the_odc_sync_replaces():
    """TRL's own class (importable without vLLM) has the methods the ODC trainer replaces and wraps, and the helper
    its sleep-mode wake-up calls."""
    import inspect

    from trl.generation import vllm_generation

    cls = vllm_generation.VLLMGeneration
    assert callable(cls.sync_weights)
    assert {"prompts", "images", "num_generations", "profiler"} <= set(inspect.signature(cls.generate).parameters)
    assert callable(vllm_generation.empty_cache)


def _recording_block(events: list[str]):
    """A timing block that records entering and leaving in ``events``."""
    import contextlib

    @contextlib.contextmanager
    def around():
        events.append("enter")
        yield
        events.append("exit")

    return around


def test_vllm_hooks_replace_the_sync_and_time_generation_on_the_instance_only():
    import types

    generation = _FakeVLLMGeneration(sleep=False)
    other = _FakeVLLMGeneration(sleep=False)
    events: list[str] = []
    around = _recording_block(events)
    trainer = types.SimpleNamespace(vllm_generation=generation)
    trl_grpo.grpo_vllm_hooks(trainer, sync=lambda: events.append("odc sync"), around=around)
    trl_grpo.grpo_vllm_hooks(trainer, sync=lambda: events.append("twice"), around=around)  # idempotent
    generation.sync_weights()
    assert events == ["odc sync"] and generation.trl_syncs == 0
    events.clear()
    assert generation.generate(prompts=[[5]], images=None, num_generations=1)[1] == [[1]]
    assert events == ["enter", "odc sync", "exit"]  # TRL's in-generate sync is ODC's too
    other.sync_weights()
    assert other.trl_syncs == 1  # another instance keeps TRL's


def test_vllm_hooks_without_an_odc_sync_time_trls_own_sync_and_generation():
    import types

    generation = _FakeVLLMGeneration(sleep=False)
    events: list[str] = []
    around = _recording_block(events)
    trainer = types.SimpleNamespace(vllm_generation=generation)
    trl_grpo.grpo_vllm_hooks(trainer, sync=None, around=around)  # plain FSDP2: TRL's sync stays, timed
    generation.sync_weights()
    assert generation.trl_syncs == 1 and events == ["enter", "exit"]
    events.clear()
    generation.generate(prompts=[[5]], images=None, num_generations=1)
    # the sync TRL makes inside generate runs inside generate's block (the trainer's block counts nested ones once)
    assert generation.trl_syncs == 2 and events == ["enter", "enter", "exit", "exit"]


@pytest.mark.parametrize("sleep", [False, True])
def test_vllm_wake_up_and_prefix_cache_follow_trls_sync(monkeypatch, sleep):
    from trl.generation import vllm_generation

    emptied = []
    monkeypatch.setattr(vllm_generation, "empty_cache", lambda: emptied.append(True))
    generation = _FakeVLLMGeneration(sleep=sleep)
    trl_grpo.wake_vllm_weights(generation)
    trl_grpo.reset_vllm_prefix_cache(generation)
    expected = (["wake_up ['weights']"] if sleep else []) + ["reset_prefix_cache"]
    assert generation.llm.calls == expected
    assert emptied == ([True] if sleep else [])
    assert generation._llm_weights_sleeping is False


def test_missing_vllm_generation_is_named():
    import types

    with pytest.raises(CompatError, match=r"trl\.GRPOTrainer\.vllm_generation"):
        trl_grpo.grpo_vllm_generation(types.SimpleNamespace())
