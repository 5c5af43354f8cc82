"""Offline GRPO assets (`odc_accelerate.demo`): real continuation lengths, rule-based rewards, the rollout."""

import statistics

import pytest
import torch

from odc_accelerate.demo import (
    TargetLengthRollout,
    ascii_text_reward,
    continuation_overlap_reward,
    generate_to_target_lengths,
    load_offline_tokenizer,
    offline_grpo_dataset,
    offline_texts,
    tiny_qwen2_config,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_offline_tokenizer()


@pytest.fixture(scope="module")
def dataset(tokenizer):
    return offline_grpo_dataset(tokenizer=tokenizer)


def _tiny_model(seed=0, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    config = tiny_qwen2_config(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa").eval()


def _generation_config(tokenizer, max_new_tokens, do_sample=True):
    from transformers import GenerationConfig

    # What TRL's GRPOTrainer builds for transformers generation (temperature 1, no top-k / top-p filtering).
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        temperature=1.0 if do_sample else None,
        top_p=1.0 if do_sample else None,
        top_k=0 if do_sample else None,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id],
        disable_compile=True,
    )


def test_dataset_rows_are_real_passages_with_their_continuation_lengths(dataset, tokenizer):
    assert dataset.column_names == ["prompt", "continuation", "target_length"]
    passages = set(offline_texts(max_words=150, min_words=10))
    assert len(dataset) > 500
    assert len(set(dataset["prompt"])) == len(dataset)  # a prompt names one target
    rows = dataset.to_list()
    for row in rows:
        assert row["prompt"] + row["continuation"] in passages
    # Independent count: the tokens that follow the prompt inside the whole tokenized passage.
    whole = tokenizer([r["prompt"] + r["continuation"] for r in rows], add_special_tokens=False)["input_ids"]
    head = tokenizer([r["prompt"] for r in rows], add_special_tokens=False)["input_ids"]
    for row, w, h in zip(rows, whole, head, strict=True):
        assert w[: len(h)] == h
        assert row["target_length"] == len(w) - len(h) >= 1


def test_dataset_lengths_are_long_tailed(dataset):
    lengths = dataset["target_length"]
    median = statistics.median(lengths)
    assert max(lengths) / median > 3
    assert sum(n > 4 * median for n in lengths) / len(lengths) > 0.02  # a tail, not one outlier


def test_continuation_overlap_reward_against_hand_computation():
    completions = ["The cat the cat sat", "", "dog", [{"role": "assistant", "content": "Sat, SAT!"}]]
    continuation = ["the cat sat on the mat", "anything", "cat", "sat down"]
    # 1: words the, cat, the, cat, sat; available the x2, cat x1, sat x1 -> hits 2 + 1 + 1 = 4 of 5.
    # 2: no words -> 0. 3: no hit -> 0. 4: sat x2 against sat x1 -> 1 of 2 (case-insensitive, punctuation dropped).
    assert continuation_overlap_reward(completions, continuation) == pytest.approx([0.8, 0.0, 0.0, 0.5])
    with pytest.raises(ValueError):
        continuation_overlap_reward(["a", "b"], ["a"])


def test_ascii_text_reward_against_hand_computation():
    completions = ["ab c\n", "a日本語", "", "¿?", [{"role": "assistant", "content": "x\x00"}]]
    # 5 of 5; 1 of 4; empty -> 0; "¿" is not ASCII: 1 of 2; NUL is ASCII but neither printable nor space: 1 of 2.
    assert ascii_text_reward(completions) == pytest.approx([1.0, 0.25, 0.0, 0.5, 0.5])


def _pick(dataset, cap):
    # The shortest target, the longest that fits the cap, and one that exceeds it.
    rows = dataset.to_list()
    fits = sorted((r for r in rows if r["target_length"] <= cap), key=lambda r: r["target_length"])
    over = next(r for r in rows if r["target_length"] > cap)
    chosen = [fits[0], fits[-1], over]
    return [r["prompt"] for r in chosen], [r["target_length"] for r in chosen]


def test_rollout_lengths_eos_and_sampling(dataset, tokenizer):
    cap = 8
    model = _tiny_model()
    prompts, targets = _pick(dataset, cap)
    prompts, targets = prompts + prompts[:1], targets + targets[:1]  # a prompt twice, as GRPO's groups repeat it
    config = _generation_config(tokenizer, cap)

    def run(seed):
        torch.manual_seed(seed)
        return generate_to_target_lengths(model, tokenizer, prompts, targets, config, max_completion_length=cap)

    out = run(0)
    assert out["logprobs"] is None
    assert out["prompt_ids"] == tokenizer(prompts)["input_ids"]
    eos = tokenizer.eos_token_id
    for completion, target in zip(out["completion_ids"], targets, strict=True):
        assert len(completion) == min(target, cap)
        if target <= cap:
            assert completion[-1] == eos and eos not in completion[:-1]  # stopped at its target
        else:
            assert eos not in completion  # truncated at the cap, like any completion that did not stop
    assert run(0)["completion_ids"] == out["completion_ids"]  # seeded sampling is reproducible
    other = run(1)["completion_ids"]
    assert [len(c) for c in other] == [len(c) for c in out["completion_ids"]]
    assert other != out["completion_ids"]
    assert out["completion_ids"][0] != out["completion_ids"][-1] or targets[0] == 1  # same prompt, two samples
    assert model.training is False


def test_rollout_tokens_are_the_models_own(dataset, tokenizer):
    # Greedy decoding makes the model's choice deterministic: every kept token of the batched, left-padded, per-row
    # stopped generation must be what the model produces for that prompt alone, unpadded and unstopped.
    cap = 10
    model = _tiny_model(dtype=torch.float64).train()  # the rollout generates in eval mode and restores the mode
    prompts, targets = _pick(dataset, cap)
    config = _generation_config(tokenizer, cap, do_sample=False)
    out = generate_to_target_lengths(model, tokenizer, prompts, targets, config, max_completion_length=cap)
    assert model.training is True
    model.eval()
    for prompt, completion, target in zip(prompts, out["completion_ids"], targets, strict=True):
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        reference = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)[
            0, ids.shape[1] :
        ]
        kept = len(completion) - 1 if target <= cap else len(completion)
        assert completion[:kept] == reference[:kept].tolist()


def test_rollout_through_a_grpo_trainer(dataset, tokenizer, tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    cap = 8
    rollout = TargetLengthRollout.from_dataset(dataset)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        bf16=False,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=cap,
        report_to="none",
        use_cpu=True,
    )
    trainer = GRPOTrainer(
        model=_tiny_model(),
        reward_funcs=ascii_text_reward,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    prompts, targets = _pick(dataset, cap)
    trainer.model.train()
    torch.manual_seed(0)
    out = rollout(prompts, trainer)
    assert [len(c) for c in out["completion_ids"]] == [min(t, cap) for t in targets]
    assert trainer.model.training  # restored after generation
    with pytest.raises(KeyError, match="from_dataset"):
        rollout(["not a prompt of the dataset"], trainer)


def test_rollout_map_refuses_ambiguous_or_bad_targets(dataset):
    with pytest.raises(ValueError, match="two target lengths"):
        TargetLengthRollout(["a", "b", "a"], [3, 4, 5])
    with pytest.raises(ValueError, match="at least 1"):
        TargetLengthRollout(["a"], [0])
    with pytest.raises(ValueError, match="target_length"):
        TargetLengthRollout.from_dataset(dataset.remove_columns("target_length"))
    assert TargetLengthRollout(["a", "a"], [3, 3]).targets == {"a": 3}


class _Params:
    """What `limit_vllm_to_target_lengths` uses of `vllm.SamplingParams`: ``max_tokens`` and ``clone``."""

    def __init__(self, max_tokens):
        self.max_tokens = max_tokens

    def clone(self):
        return _Params(self.max_tokens)


class _Engine:
    """An engine whose ``generate`` records what it was given and returns, per prompt, ``max_tokens`` tokens."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        self.calls.append((prompts, sampling_params, use_tqdm))
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        return [[0] * p.max_tokens for p in params]


def test_vllm_limit_gives_each_prompt_its_target_as_max_tokens(dataset, tokenizer):
    from odc_accelerate.demo import limit_vllm_to_target_lengths

    rows = dataset.select(range(6))
    targets = dict(zip(rows["prompt"], rows["target_length"], strict=True))
    engine = _Engine()
    limit_vllm_to_target_lengths(engine, tokenizer, targets)
    cap = sorted(targets.values())[2]  # some targets below the cap, some above
    # TRL's colocated call: token-id prompts (the dataset's, tokenized as TRL does) and one SamplingParams for all
    prompts = [{"prompt_token_ids": tokenizer(text=p)["input_ids"]} for p in rows["prompt"]]
    shared = _Params(cap)
    out = engine.generate(prompts, sampling_params=shared, use_tqdm=False)
    assert [len(c) for c in out] == [min(t, cap) for t in rows["target_length"]]
    assert any(t < cap for t in rows["target_length"]) and any(t > cap for t in rows["target_length"])
    assert shared.max_tokens == cap and engine.calls[-1][2] is False  # the caller's params untouched; kwargs passed
    # No cap: the target alone
    shared.max_tokens = None
    assert [len(c) for c in engine.generate(prompts, sampling_params=shared)] == list(rows["target_length"])
    # Calls of another form pass through unchanged
    own = [_Params(3)] * len(prompts)
    assert [len(c) for c in engine.generate(prompts, own)] == [3] * len(prompts)
    assert engine.calls[-1][1] is own
    assert [len(c) for c in engine.generate(["plain text"], _Params(4))] == [4]
    # Prompts that are none of the dataset's (another use of the engine) pass through; mixed with the dataset's,
    # an unknown prompt is refused, naming what must match
    assert [len(c) for c in engine.generate([{"prompt_token_ids": [1, 2, 3]}], sampling_params=_Params(5))] == [5]
    with pytest.raises(KeyError, match="tokenized by the trainer's processing class"):
        engine.generate([prompts[0], {"prompt_token_ids": [1, 2, 3]}], sampling_params=_Params(5))


def test_vllm_limit_needs_a_colocated_vllm_trainer(dataset):
    import types

    rollout = TargetLengthRollout.from_dataset(dataset)
    for trainer in (
        types.SimpleNamespace(use_vllm=False, args=types.SimpleNamespace(vllm_mode="colocate")),
        types.SimpleNamespace(use_vllm=True, args=types.SimpleNamespace(vllm_mode="server")),
    ):
        with pytest.raises(ValueError, match="use_vllm=True, vllm_mode='colocate'"):
            rollout.limit_vllm(trainer)
