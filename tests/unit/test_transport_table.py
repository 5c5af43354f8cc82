"""The transports as a table: their facts are class attributes, every list of them is derived, and ``"auto"`` chooses
by one rule from the table (`odc_accelerate.transport.auto`), saying why."""

import logging

import pytest
import torch

from odc_accelerate.engine import hsdp
from odc_accelerate.engine.report import EngineReport
from odc_accelerate.transport import (
    TRANSPORT_CLASSES,
    TRANSPORTS,
    CudaTransport,
    HierarchicalTransport,
    NetworkTransport,
    ShmTransport,
    Transport,
    TransportChoice,
    auto,
    choose_transport,
)
from odc_accelerate.transport.registry import serving, spans_hosts

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_the_names_and_every_list_come_from_the_classes():
    assert TRANSPORTS == ("auto", "shm", "network", "hierarchical", "cuda")
    assert all(name == cls.name for name, cls in TRANSPORT_CLASSES.items())
    assert serving("cpu") == [ShmTransport, NetworkTransport, HierarchicalTransport]
    assert serving("cuda") == [CudaTransport] and serving("xpu") == []
    assert [n for n in TRANSPORTS if spans_hosts(n)] == ["network", "hierarchical"]
    assert spans_hosts(NetworkTransport.__new__(NetworkTransport)) and not spans_hosts("auto")
    with pytest.raises(TypeError):
        TRANSPORT_CLASSES["rdma"] = ShmTransport  # the table is read-only: a new transport is a row in registry.py


def _hosts(monkeypatch, per_host):
    hosts = [f"host{h}" for h, count in enumerate(per_host) for _ in range(count)]
    monkeypatch.setattr(auto, "gather_hosts", lambda group, world_size: hosts)
    return len(hosts)


@pytest.mark.parametrize(
    ("per_host", "name", "reason"),
    [
        ([2], "shm", "auto: CPU tensors, every rank on one host"),
        ([1, 1, 1], "network", "auto: CPU tensors, 3 hosts with one rank each"),
        ([2, 1], "hierarchical", "auto: CPU tensors, ranks per host [2, 1]"),
    ],
)
def test_auto_takes_the_first_transport_that_fits_the_device_and_the_hosts(
    monkeypatch, caplog, per_host, name, reason
):
    world = _hosts(monkeypatch, per_host)
    with caplog.at_level(logging.INFO, logger="odc_accelerate.transport.auto"):
        choice = choose_transport("auto", device=CPU, world_size=world)
    assert choice == TransportChoice(name=name, reason=reason)
    assert f"ODC transport 'auto' chose {name!r}" in caplog.text


def test_auto_on_gpus_runs_the_transports_own_check_and_refuses_with_it(monkeypatch, caplog):
    world = _hosts(monkeypatch, [2])
    asked = []

    def refusal(cls, *, group, world_size, device, atomics):
        asked.append(atomics)
        return None if atomics is False else "rank 1's GPU has no native atomic adds into rank 0's GPU"

    monkeypatch.setattr(CudaTransport, "auto_refusal", classmethod(refusal))
    choice = choose_transport("auto", device=CUDA, world_size=world, atomics=False)
    assert choice == TransportChoice(name="cuda", reason="auto: CUDA tensors, every rank on one host")
    with caplog.at_level(logging.ERROR, logger="odc_accelerate.transport.auto"):
        with pytest.raises(RuntimeError, match="no usable transport for CUDA tensors: rank 1's GPU has no native"):
            choose_transport("auto", device=CUDA, world_size=world, atomics=True)
    assert asked == [False, True] and "no usable transport" in caplog.text
    world = _hosts(monkeypatch, [1, 1])  # no CUDA transport spans hosts
    with pytest.raises(
        NotImplementedError, match="no cross-host transport for CUDA tensors yet \\(ranks span 2 hosts"
    ):
        choose_transport("auto", device=CUDA, world_size=world)
    with pytest.raises(NotImplementedError, match="no transport for xpu tensors"):
        choose_transport("auto", device=torch.device("xpu"), world_size=world)


def test_a_named_or_given_transport_is_kept_and_says_so(monkeypatch):
    monkeypatch.setattr(auto, "gather_hosts", None)  # no collective for a transport that is named
    assert choose_transport("network", device=CPU, world_size=2) == TransportChoice(
        name="network", reason="set by odc_transport"
    )
    given = ShmTransport.__new__(ShmTransport)
    assert choose_transport(given, device=CUDA, world_size=2) == TransportChoice(
        name="shm", reason="given as a Transport"
    )
    with pytest.raises(ValueError, match="unknown ODC transport 'rdma'; choose one of \\['auto', 'shm'"):
        choose_transport("rdma", device=CPU, world_size=2)


def test_the_base_class_rules_that_a_new_transport_inherits():
    class OneHost(Transport):  # the defaults: one host, atomic adds, one way of adding
        name = "one-host"
        devices = ("cpu",)

    assert OneHost.fits_hosts([4]) and not OneHost.fits_hosts([2, 2])
    assert HierarchicalTransport.fits_hosts([2, 2]) and not NetworkTransport.fits_hosts([2, 2])
    assert OneHost.auto_refusal(group=None, world_size=2, device=CPU, atomics=True) is None
    assert (OneHost.adds_atomically, OneHost.accumulate_path, OneHost.spans_hosts) == (True, None, False)


def test_hsdp_accepts_a_transport_that_spans_hosts_without_asking_the_hosts():
    hsdp.check_shard_group_hosts([[0, 1], [2, 3]], spans_hosts=True)  # no collective: no process group here


def test_the_engine_report_formats_its_log_line():
    report = EngineReport(
        transport="shm",
        transport_reason="auto: CPU tensors, every rank on one host",
        accumulate_path=None,
        accumulate_reason="",
        reduction="ordered",
        reduction_reason="set by odc_reduction",
        param_groups=3,
        frozen=False,
        ranks=2,
        replicas=2,
        replicate_buckets=1,
        memory_policy="neither",
        memory="neither x3",
    )
    assert report.describe() == (
        "3 param groups, transport shm, ordered reduction (set by odc_reduction), HSDP: 2 replicas, 1 all-reduce "
        "bucket(s) per step, memory policy neither: neither x3"
    )
    with pytest.raises(AttributeError):
        report.transport = "network"  # frozen
