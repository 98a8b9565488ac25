"""ductile._round_sockets: which TCP connections a process group made, and
shutting them once, never after the group's owner retired them, and never a
socket that took a shut one's descriptor number."""

import os
import socket

import pytest

from ductile import _round_sockets


@pytest.fixture
def listener():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server
    server.close()


def connect(listener):
    """A connected pair: (this side, the accepted side)."""
    client = socket.create_connection(listener.getsockname())
    accepted, _ = listener.accept()
    return client, accepted


def inode(sock):
    return os.fstat(sock.fileno()).st_ino


def test_the_connections_made_since_a_moment_less_the_store_and_listeners(listener):
    old, old_peer = connect(listener)
    before = _round_sockets.socket_inodes()
    assert inode(old) in before
    other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    other.bind(("127.0.0.1", 0))
    other.listen(1)  # a listener made meanwhile: not a connection
    new, new_peer = connect(listener)
    store, store_peer = connect(listener)
    made = _round_sockets.made_since(before)
    # Both ends are this process's: the connection and its accepted side.
    assert {inode(new), inode(new_peer), inode(store), inode(store_peer)} <= made
    assert inode(old) not in made and inode(other) not in made
    # The store's port: the client's side of it is left out.
    skipped = _round_sockets.made_since(before, skip_port=listener.getsockname()[1])
    assert inode(store) not in skipped and inode(new) not in skipped
    assert inode(new_peer) in skipped  # its peer port is the client's
    assert _round_sockets.made_since(None) == frozenset()
    for s in (old, old_peer, other, new, new_peer, store, store_peer):
        s.close()


def test_shut_once_ends_the_peers_reads_and_retired_is_never_shut(listener):
    mine, peer = connect(listener)
    kept, kept_peer = connect(listener)
    connections = _round_sockets.Connections(4, frozenset({inode(mine)}))
    assert connections.round == 4 and not connections.retired
    assert connections.shut() == 1
    peer.settimeout(5)
    assert peer.recv(16) == b""  # the end of the stream, as when a process dies
    assert connections.retired and connections.shut() == 0
    kept.sendall(b"x")  # not one of its connections: untouched
    assert kept_peer.recv(1) == b"x"

    later = _round_sockets.Connections(5, frozenset({inode(kept)}))
    later.retire()
    assert later.shut() == 0
    kept.sendall(b"y")
    assert kept_peer.recv(1) == b"y"
    assert _round_sockets.Connections(6, frozenset()).retired  # nothing to shut
    for s in (mine, peer, kept, kept_peer):
        s.close()


def test_a_descriptor_number_reused_by_another_socket_is_not_shut(listener):
    gone, gone_peer = connect(listener)
    recorded = frozenset({inode(gone)})
    number = gone.fileno()
    gone.close()
    reused, reused_peer = connect(listener)
    assert number in (reused.fileno(), reused_peer.fileno())  # the lowest free number
    assert _round_sockets.Connections(2, recorded).shut() == 0
    reused.sendall(b"z")
    assert reused_peer.recv(1) == b"z"
    for s in (gone_peer, reused, reused_peer):
        s.close()


def test_the_baseline_is_none_until_noted():
    saved = list(_round_sockets._baseline)
    try:
        _round_sockets._baseline[:] = []
        assert _round_sockets.baseline() is None
        _round_sockets.note_baseline()
        assert _round_sockets.baseline() == _round_sockets.socket_inodes()
    finally:
        _round_sockets._baseline[:] = saved
