"""`LocalAddFence`: the ordered reduction's local adds are ordered by the engine's own events, not FSDP2's."""

import torch

from odc_accelerate.engine.streams import LocalAddFence, current_stream_of
from tests.helpers.infra.fake_streams import FakeStreams


def test_adds_on_the_reduce_scatter_stream_are_waited_for_and_wait_for_the_zeroing():
    streams = FakeStreams()
    fence = LocalAddFence(streams)
    streams.current = "reduce-scatter"  # FSDP2 runs the hook on its own stream
    for _ in range(2):  # two microbatches
        fence.before_add()
        fence.after_add()
    assert streams.log == [("record", "reduce-scatter", 0), ("record", "reduce-scatter", 1)]
    streams.current = "default"
    fence.wait_for_adds()  # pre_optimizer_step, before the barrier: the latest add's event, whatever stream is current
    assert streams.log[-1] == ("synchronize", "reduce-scatter", 1)
    fence.wait_for_adds()  # nothing added since: nothing to wait for
    assert streams.log[-1] == ("synchronize", "reduce-scatter", 1)
    fence.after_zero()  # post_optimizer_step zeroes on the current stream
    assert streams.log[-1] == ("record", "default", 2)
    streams.current = "reduce-scatter"
    fence.before_add()  # the next step's first add waits for the zeroing
    assert streams.log[-1] == ("wait", "reduce-scatter", 2)


def test_no_streams_on_cpu():
    assert current_stream_of(torch.device("cpu")) is None
    fence = LocalAddFence(None)
    fence.before_add()
    fence.after_add()
    fence.after_zero()
    fence.wait_for_adds()
