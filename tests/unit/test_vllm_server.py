"""ODC's weight sync into a vLLM server (`odc_accelerate.integrations.vllm_server`), in one process without vLLM: the
channel by device, the refusals of `push_weights_to_server`, and TRL's client kept out of NCCL without CUDA. The sync
itself against a real server: tests/vllm/test_vllm_server.py."""

from __future__ import annotations

import pytest
import torch

from odc_accelerate._compat.trl import grpo as trl_grpo
from odc_accelerate.integrations.vllm_server import push_weights_to_server, server_channel
from tests.conftest import requires_trl_116


def test_the_channel_follows_the_device():
    assert server_channel(torch.device("cuda", 1)) == "nccl"
    assert server_channel(torch.device("cpu")) == "file"
    assert server_channel("cpu") == "file"


def test_push_refuses_an_unknown_channel_and_a_file_channel_without_a_directory():
    with pytest.raises(ValueError, match="unknown vLLM server channel 'http'"):
        push_weights_to_server(object(), object(), "http")
    with pytest.raises(ValueError, match="needs a weights_dir the vLLM server can read"):
        push_weights_to_server(object(), object(), "file")


class _Client:
    def __init__(self) -> None:
        self.asked = 0
        self.base_url = "http://127.0.0.1:1"

    def get_server_info(self) -> dict:
        self.asked += 1
        return {"weight_transfer_config": None}


@requires_trl_116
def test_without_cuda_the_client_checks_the_server_and_joins_no_nccl_group():
    from trl.generation.vllm_client import VLLMClient

    original = VLLMClient.init_communicator
    client = _Client()
    with trl_grpo.vllm_server_without_communicator(lambda device: str(device) == "cpu"):
        VLLMClient.init_communicator(client, device="cpu")  # TRL's own would raise: no weight-transfer engine
        assert client.asked == 1
        # where ODC does not reload from files, TRL's own runs (and refuses this server, as TRL does)
        with pytest.raises(RuntimeError, match="no weight-transfer engine"):
            VLLMClient.init_communicator(client, device="cuda")
    assert VLLMClient.init_communicator is original
