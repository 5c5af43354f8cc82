"""The offline tokenizer with fewer BPE ranks (``ODC_OFFLINE_BPE_RANKS``), against the full one."""

from __future__ import annotations

import pytest

from odc_accelerate import demo


@pytest.fixture
def tokenizers(monkeypatch, tmp_path):
    monkeypatch.delenv("ODC_OFFLINE_BPE_RANKS", raising=False)
    full = demo.load_offline_tokenizer()  # the cached full tokenizer of this machine
    monkeypatch.setenv("ODC_OFFLINE_BPE_RANKS", "1000")
    small = demo.load_offline_tokenizer(cache_dir=str(tmp_path))
    return full, small


def test_fewer_ranks_is_a_valid_bpe_that_keeps_the_full_tokenizers_ids(tokenizers, tmp_path):
    full, small = tokenizers
    assert (tmp_path / "qwen_tokenizer_1000" / "tokenizer.json").is_file()
    texts = demo.offline_texts()[:40]
    for text in texts:
        ids = small(text)["input_ids"]
        assert small.decode(ids) == text  # every text still tokenizes, losslessly
        assert max(ids) < 1000
        # Each kept token is the full tokenizer's token of the same id: the same bytes.
        assert small.convert_ids_to_tokens(ids) == full.convert_ids_to_tokens(ids)
    assert sum(len(small(t)["input_ids"]) for t in texts) > sum(len(full(t)["input_ids"]) for t in texts)
    # Special tokens follow the kept ranks, in Qwen's order.
    assert small.eos_token_id == small.pad_token_id == 1000
    assert small.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1001, 1002]
    assert full.eos_token_id == demo.QWEN_BPE_RANKS


def test_the_model_config_follows_the_kept_ranks(tokenizers, monkeypatch):
    full, small = tokenizers
    config = demo.tiny_qwen2_config()
    assert config.vocab_size == demo.offline_vocab_size() == 1280  # 1000 ranks + 208 specials, padded to 128
    assert len(small) <= config.vocab_size
    assert config.eos_token_id == config.pad_token_id == small.eos_token_id
    monkeypatch.delenv("ODC_OFFLINE_BPE_RANKS")
    config = demo.tiny_qwen2_config()
    assert config.vocab_size == demo.QWEN_VOCAB_SIZE == demo.offline_vocab_size()  # Qwen2's own padding
    assert len(full) <= config.vocab_size and config.eos_token_id == full.eos_token_id


@pytest.mark.parametrize("value", ["abc", "0", "255", "151644", "8k"])
def test_bad_rank_counts_name_the_range(monkeypatch, value):
    monkeypatch.setenv("ODC_OFFLINE_BPE_RANKS", value)
    with pytest.raises(ValueError, match=r"ODC_OFFLINE_BPE_RANKS=.*from 256 .* to 151643"):
        demo.offline_bpe_ranks()
