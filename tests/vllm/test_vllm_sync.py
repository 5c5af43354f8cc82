"""ODC's weight sync into vLLM (`odc_accelerate.integrations.vllm`): 2 gloo ranks on CPU, each with its own in-process
vLLM engine, refreshed from ODC's published shards after an optimizer step with no torch.distributed call."""

import pytest

from odc_accelerate.testing import launch, read_pids, shm_files_of
from tests.helpers.vllm_workers import VLLM_ENV, tiny_model_and_tokenizer, train_sync_generate


@pytest.mark.multiprocess
def test_synced_vllm_generates_as_the_trained_model_without_collectives(tmp_path):
    model, tokenizer = tiny_model_and_tokenizer(seed=0)
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
        # The step changed what the model generates (the comparison above would catch a sync that did nothing).
        assert r["vllm"] != r["vllm_initial"], where
        assert r["calls"] == {}, f"{where} made torch.distributed calls during sync and generation: {r['calls']}"
        # ODC's reads give DTensor's gather bit for bit, under the model's own (Hugging Face) names.
        assert r["odc_equals_gather"] and r["odc_names"], where
        assert r["sync"]["units"] == 3 and r["sync"]["parameters"] > 0, r["sync"]
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
