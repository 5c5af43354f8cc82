"""A small transformer-like language model for tests and benchmarks, plus FSDP2 wrapping and data; tiny Hugging
Face causal LMs (untied, tied, mixture of experts, hybrid linear attention) built from configs for the offline
vocabulary; and a tiny Qwen3-VL-shaped vision-language model with its processor and synthetic image+text samples.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ToyConfig:
    vocab: int = 128
    dim: int = 32
    heads: int = 4
    layers: int = 3
    mlp_ratio: int = 4
    # Each block also has a `gate` (registered between the attention and the MLP) that only sequences of odd length
    # go through: a backward of an even-length sequence gives its params no gradient.
    gated: bool = False


class Block(nn.Module):
    """Pre-norm block: causal self-attention (SDPA) and an MLP, each residual."""

    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.dim)
        # No qkv bias (as in Llama): the key bias gets a mathematically zero gradient, whose rounding noise
        # AdamW would amplify into spurious parameter differences between equivalent runs.
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.gate = nn.Linear(cfg.dim, cfg.dim) if cfg.gated else None
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, cfg.mlp_ratio * cfg.dim)
        self.down = nn.Linear(cfg.mlp_ratio * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        if self.gate is not None and t % 2 == 1:
            x = x + self.gate(x)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ToyLM(nn.Module):
    def __init__(self, cfg: ToyConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(cfg: ToyConfig, seed: int = 0) -> ToyLM:
    torch.manual_seed(seed)
    return ToyLM(cfg)


def world_mesh(device_type: str):
    """One 1-D DeviceMesh on the default (world) process group.

    ``fully_shard`` without ``mesh=`` builds its own default mesh per call; under a gloo default group on a CUDA
    machine each of those gets a new process group. One mesh passed to every call keeps one group, as a real job has.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dist.group.WORLD, device_type)


def shard_model(
    model: ToyLM,
    *,
    mp_policy=None,
    reshard_after_forward: bool | int = True,
    shard_placement_fn: Callable | None = None,
    mesh=None,
    block_mesh=None,
) -> ToyLM:
    """FSDP2-wrap like accelerate does: each block, then the root (embedding, final norm, head).

    ``mesh`` defaults to :func:`world_mesh` on the model's device type; ``block_mesh`` (default ``mesh``) is the
    blocks' own, e.g. a second mesh over the same ranks.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh is None:
        mesh = world_mesh(next(model.parameters()).device.type)
    kwargs = dict(
        mp_policy=mp_policy or MixedPrecisionPolicy(),
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
    )
    for block in model.blocks:
        fully_shard(block, mesh=block_mesh if block_mesh is not None else mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def token_loss_sum(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross entropy of ``ids`` [B, T] and the number of label tokens."""
    logits = model(ids[:, :-1])
    labels = ids[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), reduction="sum")
    return loss, labels.numel()


def make_steps(plan: list[list[list[int]]], vocab: int, seed: int) -> list[list[list[torch.Tensor]]]:
    """Token batches for ``plan[step][rank] = [seq_len, ...]`` (one sequence per microbatch)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        [[torch.randint(0, vocab, (1, length + 1), generator=gen) for length in rank_plan] for rank_plan in step]
        for step in plan
    ]


# ------------------------------------------------------------------------------------------ tiny Hugging Face models
#: The kinds of tiny causal LMs `tiny_causal_lm_config` builds: the offline default (untied Qwen2), a Llama 3.2-shaped
#: model whose LM head is the input embedding (as Qwen2.5 0.5B-3B, Llama 3.2 1B/3B and Gemma ship), and a Qwen3-MoE
#: (experts fused as transformers 5 stores them: ``experts.gate_up_proj`` / ``experts.down_proj``), and a Qwen3.5-MoE
#: hybrid (Gated DeltaNet linear attention and full attention).
TINY_MODEL_KINDS = ("untied", "tied", "moe", "hybrid")


def tiny_causal_lm_config(kind: str = "untied", hidden_size: int = 64) -> Any:
    """A small `transformers` config of ``kind`` (one of `TINY_MODEL_KINDS`), random init, sized for CPU runs and
    for the vocabulary of `odc_accelerate.demo.load_offline_tokenizer` (``ODC_OFFLINE_BPE_RANKS`` shrinks it).

    * ``"untied"``: `odc_accelerate.demo.tiny_qwen2_config` (the scripts' offline default).
    * ``"tied"``: a `LlamaConfig` shaped as Llama 3.2 (grouped-query attention, no biases, ``llama3`` RoPE scaling,
      ``tie_word_embeddings=True``): ``lm_head.weight`` is ``model.embed_tokens.weight``.
    * ``"moe"``: a `Qwen3MoeConfig` with 4 experts, 2 per token, every layer sparse. The router's auxiliary loss keeps
      the architecture's coefficient (TRL's trainers turn it on from it unless ``router_aux_loss_coef=0``).
    * ``"hybrid"``: a `Qwen3_5MoeTextConfig` (``Qwen3_5MoeForCausalLM``, text only) shaped as Qwen3.5 / 3.6: 3 Gated
      DeltaNet (``linear_attention``) layers and 1 gated full-attention layer, 4 experts, 2 per token, and a shared
      expert. Without ``flash-linear-attention`` / ``causal-conv1d`` transformers runs its PyTorch fallback (slow).
    """
    from odc_accelerate.demo import offline_bpe_ranks, offline_vocab_size, tiny_qwen2_config

    if kind not in TINY_MODEL_KINDS:
        raise ValueError(f"Unknown tiny model kind {kind!r}; choose one of {', '.join(TINY_MODEL_KINDS)}.")
    if kind == "untied":
        return tiny_qwen2_config(hidden_size=hidden_size)
    eos = offline_bpe_ranks()  # <|endoftext|>, the first special token after the kept ranks
    common = dict(
        vocab_size=offline_vocab_size(),
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=4096,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    if kind == "hybrid":
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(
            moe_intermediate_size=hidden_size,
            shared_expert_intermediate_size=hidden_size,
            num_experts=4,
            num_experts_per_tok=2,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=hidden_size // 4,
            linear_value_head_dim=hidden_size // 4,
            tie_word_embeddings=False,
            **{**common, "num_hidden_layers": 4},
        )
    if kind == "tied":
        from transformers import LlamaConfig

        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        common["max_position_embeddings"] = 131072  # as Llama 3.2: above the scaling's original 8,192
        return LlamaConfig(
            intermediate_size=4 * hidden_size,
            rope_parameters=rope,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            **common,
        )
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        intermediate_size=4 * hidden_size,
        moe_intermediate_size=hidden_size,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        **common,
    )


def save_tiny_causal_lm(kind: str, path: str | os.PathLike, seed: int = 0, hidden_size: int = 64) -> Path:
    """Build the tiny model of ``kind`` (`tiny_causal_lm_config`) in fp32 with ``seed`` and save it, with the offline
    tokenizer, to ``path``: a folder the scripts load with ``--model_name_or_path path`` (no network). Returns the
    folder."""
    from transformers import AutoModelForCausalLM, set_seed

    from odc_accelerate.demo import load_offline_tokenizer

    set_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_causal_lm_config(kind, hidden_size), dtype=torch.float32)
    out = Path(path)
    model.save_pretrained(out)
    load_offline_tokenizer().save_pretrained(out)
    return out


def tiny_reward_model(kind: str = "untied", seed: int = 0, hidden_size: int = 64) -> Any:
    """The tiny model of ``kind`` (`tiny_causal_lm_config`) as a reward model: a sequence classifier with one output
    (``Qwen2ForSequenceClassification``, ``LlamaForSequenceClassification``, ...), fp32, built with ``seed``. Its
    config's pad token is the offline tokenizer's, which the classifier uses to find each row's last token. The
    ``untied`` one is what ``odc-accelerate reward`` trains by default (same seed, same weights)."""
    from transformers import AutoModelForSequenceClassification, set_seed

    from odc_accelerate.demo import load_offline_tokenizer

    config = tiny_causal_lm_config(kind, hidden_size)
    config.num_labels = 1
    config.pad_token_id = load_offline_tokenizer().pad_token_id
    set_seed(seed)
    return AutoModelForSequenceClassification.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def save_tiny_reward_model(kind: str, path: str | os.PathLike, seed: int = 0, hidden_size: int = 64) -> Path:
    """`tiny_reward_model` saved with the offline tokenizer to ``path``: a folder TRL's reward script loads with
    ``--model_name_or_path path`` (no network). Returns the folder."""
    from odc_accelerate.demo import load_offline_tokenizer

    out = Path(path)
    tiny_reward_model(kind, seed, hidden_size).save_pretrained(out)
    load_offline_tokenizer().save_pretrained(out)
    return out


# ------------------------------------------------------------------------------------------ tiny vision-language model
#: The special tokens a Qwen3-VL processor reads, added to the offline tokenizer (ids after its own specials).
VLM_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
#: A ChatML template that renders an ``{"type": "image"}`` part as Qwen-VL does (one placeholder, which the processor
#: expands to the image's tokens).
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
#: Patch and merge sizes of the tiny vision tower (Qwen3-VL's are 16 and 2): an image of H x W pixels gives
#: (H/8) x (W/8) patches, ``pixel_values`` rows, and a quarter as many image tokens in the text.
VLM_PATCH, VLM_MERGE = 8, 2


def tiny_vlm_processor_class() -> type:
    """`TinyQwen3VLProcessor`: transformers' `Qwen3VLProcessor` without its video processor.

    transformers builds a Qwen3-VL processor only with its video processor, which needs ``torchvision``; images alone
    need neither. A folder saved with this class loads with `transformers.AutoProcessor` once
    `register_tiny_vlm_processor` ran in the process.
    """
    global _TINY_VLM_PROCESSOR
    if _TINY_VLM_PROCESSOR is None:
        from transformers import Qwen3VLProcessor

        class TinyQwen3VLProcessor(Qwen3VLProcessor):
            def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kw):
                # ProcessorMixin pairs the positional sub-processors with this signature's: the video one is dropped.
                super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kw)

        TinyQwen3VLProcessor.__module__ = __name__
        _TINY_VLM_PROCESSOR = TinyQwen3VLProcessor
    return _TINY_VLM_PROCESSOR


_TINY_VLM_PROCESSOR: type | None = None


def register_tiny_vlm_processor() -> None:
    """Make `transformers.AutoProcessor` load folders saved by `save_tiny_vlm` (their processor class)."""
    from transformers import AutoProcessor, Qwen3VLConfig

    AutoProcessor.register(Qwen3VLConfig, tiny_vlm_processor_class(), exist_ok=True)


def tiny_vlm_processor() -> Any:
    """The tiny VLM's processor: the offline tokenizer with `VLM_SPECIAL_TOKENS` and `VLM_CHAT_TEMPLATE`, and a
    `Qwen2VLImageProcessorPil` (Qwen3-VL's image processor, PIL backend) that resizes images to at most 64 x 64."""
    from transformers import Qwen2VLImageProcessorPil

    from odc_accelerate.demo import load_offline_tokenizer

    tokenizer = load_offline_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VLM_SPECIAL_TOKENS]})
    side = VLM_PATCH * VLM_MERGE
    images = Qwen2VLImageProcessorPil(
        patch_size=VLM_PATCH,
        temporal_patch_size=2,
        merge_size=VLM_MERGE,
        size={"shortest_edge": side * side, "longest_edge": 64 * 64},
    )
    return tiny_vlm_processor_class()(image_processor=images, tokenizer=tokenizer, chat_template=VLM_CHAT_TEMPLATE)


def tiny_vlm_config(hidden_size: int = 64, processor: Any = None) -> Any:
    """A `Qwen3VLConfig` shaped as Qwen3-VL (a vision tower of 2 blocks with a deepstack merger, multimodal RoPE, a
    text model of 2 decoder layers), for `tiny_vlm_processor`'s token ids."""
    from transformers import Qwen3VLConfig

    from odc_accelerate.demo import offline_vocab_size

    tokenizer = (processor or tiny_vlm_processor()).tokenizer
    ids = dict(zip(VLM_SPECIAL_TOKENS, tokenizer.convert_tokens_to_ids(list(VLM_SPECIAL_TOKENS)), strict=True))
    text = dict(
        vocab_size=max(offline_vocab_size(), len(tokenizer)),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5e5,
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
        pad_token_id=tokenizer.pad_token_id,
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=VLM_PATCH,
        temporal_patch_size=2,
        spatial_merge_size=VLM_MERGE,
        out_hidden_size=hidden_size,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def save_tiny_vlm(path: str | os.PathLike, seed: int = 0, hidden_size: int = 64) -> Path:
    """Build the tiny `Qwen3VLForConditionalGeneration` (`tiny_vlm_config`) in fp32 with ``seed`` and save it with
    `tiny_vlm_processor` to ``path``, a folder TRL's SFT script loads with ``--model_name_or_path path`` once
    `register_tiny_vlm_processor` ran. Returns the folder."""
    from transformers import Qwen3VLForConditionalGeneration, set_seed

    processor = tiny_vlm_processor()
    set_seed(seed)
    model = Qwen3VLForConditionalGeneration(tiny_vlm_config(hidden_size, processor)).to(torch.float32)
    out = Path(path)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


def tiny_vlm_dataset(rows: int = 16, seed: int = 0) -> Any:
    """``rows`` conversational image+text samples (TRL's vision format: an ``images`` list and ``messages``): each a
    random RGB image (from ``seed``) of 16 to 64 pixels a side in steps of 16 (1 to 16 image tokens), a question, and
    an answer from the offline text of 4 to 40 words. Returns a `datasets.Dataset` (images as its `Image` feature)."""
    import numpy as np
    from datasets import Dataset, Features, Image, List, Value
    from PIL import Image as PILImage

    from odc_accelerate.demo import offline_texts

    rng = np.random.default_rng(seed)
    words = " ".join(offline_texts()).split()
    images, messages = [], []
    for _ in range(rows):
        height, width = (int(x) * 16 for x in rng.integers(1, 5, size=2))
        images.append([PILImage.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))])
        start, count = int(rng.integers(0, len(words) - 40)), int(rng.integers(4, 41))
        question = [{"type": "image", "text": None}, {"type": "text", "text": "Describe the picture."}]
        answer = [{"type": "text", "text": " ".join(words[start : start + count])}]
        messages.append([{"role": "user", "content": question}, {"role": "assistant", "content": answer}])
    part = {"type": Value("string"), "text": Value("string")}
    features = Features(images=List(Image()), messages=List({"role": Value("string"), "content": List(part)}))
    return Dataset.from_dict({"images": images, "messages": messages}, features=features)
