"""The C++ host world over a Python communicator (python/src/host_world.cpp):
the world's facts cross once, typed, as _ductile.zero.HostCommunicator's;
C++ calls Python only through that class's methods, and a collective's
handle must be a _ductile.zero.HostWork. One process, a real coordinator
session on the cpu accelerator, a world of one rank defined here."""

import pytest
import torch

from ductile import _ductile
from ductile._errors import CommunicationError, InvalidArgumentError

CONFIG = """
[accelerator]
backend = "cpu"
communicator = "auto"
timeout = 60

[zero]
coordinator = "partitioned"
"""


class CountedWork(_ductile.zero.HostWork):
    """A collective that is complete once waited for, counting the calls."""

    def __init__(self):
        _ductile.zero.HostWork.__init__(self)
        self.queries = 0
        self.waits = 0

    def query(self):
        self.queries += 1
        return self.waits > 0

    def wait(self):
        self.waits += 1


class OneRankWorld(_ductile.zero.HostCommunicator):
    """A world of one rank whose gathers copy the send into the output and
    return `handle` (None: a CountedWork each)."""

    def __init__(self, handle=None):
        _ductile.zero.HostCommunicator.__init__(
            self, rank=0, size=1, kind="recording", group=None, gather_collective=None,
            direct_exchange=False, direct_tag=0)
        self.handle = handle
        self.calls = []

    def all_gather_at(self, send, recv, count, dtype, stream):
        self.calls.append(("all_gather_at", count, dtype, stream))
        nbytes = count * torch.empty((), dtype=getattr(torch, dtype)).element_size()
        out = torch.frombuffer(_ductile.zero.host_view(recv, nbytes), dtype=torch.uint8)
        out.copy_(torch.frombuffer(_ductile.zero.host_view(send, nbytes), dtype=torch.uint8))
        return CountedWork() if self.handle is None else self.handle

    def broadcast_at(self, buffer, count, dtype, root, stream):
        self.calls.append(("broadcast_at", count, dtype, root, stream))
        return CountedWork()


def session(world):
    return _ductile.zero.Session(_ductile.Runtime.from_toml(CONFIG), world)


def test_facts_are_the_bases_typed_read_only_properties():
    world = OneRankWorld()
    assert (world.rank, world.size, world.kind, world.group, world.direct_exchange,
            world.direct_tag) == (0, 1, "recording", None, False, 0)
    with pytest.raises(AttributeError):
        world.rank = 1

    class OutsideWorld(_ductile.zero.HostCommunicator):
        def __init__(self):
            _ductile.zero.HostCommunicator.__init__(
                self, rank=2, size=2, kind="outside", group=None, gather_collective=None,
                direct_exchange=False, direct_tag=0)

    with pytest.raises(InvalidArgumentError,
                       match=r"rank = 2 with size = 2 is not a rank of the world; .* rank in "
                             r"\[0, size\)"):
        OutsideWorld()


def test_the_coordinator_calls_the_worlds_methods_and_its_handles():
    world = OneRankWorld()
    s = session(world)
    assert s.host_world and (s.rank, s.size) == (0, 1)
    send = torch.arange(5, dtype=torch.float32)
    recv = torch.zeros(5, dtype=torch.float32)
    handle = s.all_gather(send.data_ptr(), recv.data_ptr(), 5, "float32")
    handle.wait()
    assert torch.equal(recv, send)
    # The stream argument is None on host streams: the stream was synchronised first.
    assert world.calls == [("all_gather_at", 5, "float32", None)]
    assert handle.query()
    s.broadcast(recv.data_ptr(), 5, "float32", 0).wait()
    assert world.calls[-1] == ("broadcast_at", 5, "float32", 0, None)


def test_a_handle_seen_through_cpp_calls_the_python_overrides():
    work = CountedWork()
    s = session(OneRankWorld(handle=work))
    data = torch.ones(3)
    handle = s.all_gather(data.data_ptr(), data.data_ptr(), 3, "float32")
    assert not handle.query() and work.queries == 1
    handle.wait()
    assert work.waits == 1
    assert handle.query() and work.queries == 1  # complete: not asked again


class Plain:
    """A handle with the calls but not the type."""

    def query(self):
        return True

    def wait(self):
        return None


class Duck:
    """A world with the facts as plain attributes, not a HostCommunicator."""

    rank, size, kind = 0, 1, "duck"


def test_a_handle_that_is_not_a_host_work_names_the_call_and_the_type():
    s = session(OneRankWorld(handle=Plain()))
    data = torch.ones(3)
    with pytest.raises(CommunicationError,
                       match=r"all_gather \(recording host world, rank 0 of 1\): the host world "
                             r"returned a Plain, not a HostWork"):
        s.all_gather(data.data_ptr(), data.data_ptr(), 3, "float32")


def test_a_host_world_that_is_not_a_host_communicator_is_refused():
    with pytest.raises(InvalidArgumentError,
                       match=r"host_world = a Duck is not a host communicator; give a "
                             r"_ductile.zero.HostCommunicator"):
        session(Duck())
