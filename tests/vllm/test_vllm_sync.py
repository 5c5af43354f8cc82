"""ODC's weight sync into vLLM (`odc_accelerate.integrations.vllm`): 2 gloo ranks on CPU, each with its own in-process
vLLM engine, refreshed from ODC's published shards after an optimizer step with no torch.distributed call; on the tiny
Qwen2 untied and tied (``tie_word_embeddings``, as Qwen2.5 0.5B-3B: vLLM's reload processes the tied LM head as a
layer of its own, and keeps the old head unless the sync sends it under its own name)."""

import pytest

from odc_accelerate.testing import launch, read_pids, shm_files_of
from tests.helpers.loops.vllm_trainer_check import LOGPROB_TOLERANCE
from tests.helpers.workers.vllm_workers import VLLM_ENV, tiny_model_and_tokenizer, train_sync_generate


@pytest.mark.multiprocess
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_synced_vllm_generates_as_the_trained_model_without_collectives(tmp_path, tied):
    model, tokenizer = tiny_model_and_tokenizer(seed=0, tied=tied)
    path = tmp_path / "initial"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()

    results = launch(train_sync_generate, 2, {"path": str(path), "pid_dir": pid_dir}, timeout=600, env=VLLM_ENV)

    for rank, r in enumerate(results):
        where = f"rank {rank}"
        # The engine holds exactly the trained weights: greedy generation equals HF's on the gathered model.
        assert r["vllm"] == r["hf"], f"{where}: vLLM {r['vllm']} != HF {r['hf']}"
        # ... and its log-probabilities of every position of the check prompts equal HF's, before the step and after
        # the sync, while the stale engine's differ from the trained model's by far more than the tolerance
        assert r["logprobs_initial"] < LOGPROB_TOLERANCE and r["logprobs_synced"] < LOGPROB_TOLERANCE, r
        assert r["logprobs_stale"] > 10 * LOGPROB_TOLERANCE, r["logprobs_stale"]
        # The step changed what the model generates (the comparison above would catch a sync that did nothing).
        assert r["vllm"] != r["vllm_initial"], where
        assert r["calls"] == {}, f"{where} made torch.distributed calls during sync and generation: {r['calls']}"
        # ODC's reads give DTensor's gather bit for bit, under the model's own (Hugging Face) names.
        assert r["odc_equals_gather"] and r["odc_names"], where
        # every parameter once, a tied weight also under the LM head's name; every one of vLLM's parameters loaded
        assert r["sync"]["units"] == 3 and r["sync"]["parameters"] == r["full_names"] + tied, r["sync"]
        assert r["sync"]["loaded"] > 0, r["sync"]
        assert "between optimizer steps" in r["inside_step_error"], r["inside_step_error"]
        assert r["dist_after_shutdown"], f"{where}: shutting vLLM down destroyed the job's process group"
    assert len(results[0]["vllm"]) == 2 and len(results[1]["vllm"]) == 3
    for rank, r in enumerate(results):
        print(
            f"rank {rank}: engine up {r['engine_start_s']:.1f} s, sync {r['sync_s']:.2f} s (of which unsharding and "
            f"copying {r['sync']['gather_seconds']:.2f} s) "
            f"({r['sync']['bytes'] / 2**20:.1f} MiB in {r['sync']['units']} units, largest "
            f"{r['sync']['max_unit_bytes'] / 2**20:.1f} MiB), generation {r['generate_s']:.2f} s"
        )
    assert shm_files_of(read_pids(pid_dir)) == []
