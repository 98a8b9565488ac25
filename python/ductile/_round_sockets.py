"""The TCP connections of a worker's process group, for shutting them when
the group is left while one of its collectives still waits.

Under ``ductile agent``, a peer that goes silent (SIGSTOP, a cut cable, a
hung host) keeps its connections open: a collective that waits on it
waits until the group's timeout, and gloo's ``abort()`` does not close
them. A survivor held so cannot read its round notice, and its agent
would have to start it again. Shutting the group's connections from
another thread makes gloo's waits fail at once, as when the peer's
process dies, and the worker recovers from that failure as from a lost
peer (zero3/_rejoin.py).

Which connections: the TCP connections this process made while the group
was made. For the group torch's ``init_process_group`` made in the user's
script, those opened between ``import ductile`` (``note_baseline``, under
the agent) and the engine's creation, less the one to the round's store;
for a group the engine made when it rejoined, those opened by
``init_process_group`` itself. A group made before ``import ductile``
yields none: its waits are then left to the agent, as before.

Linux only (``/proc``); elsewhere no connection is found.

Threading: Connections.shut and retire may run on any thread; each takes
the object's lock, so the connections are shut at most once and never
after retire() (the process group is destroyed after that, and its
descriptors' numbers may be reused).
Errors: none raised; a descriptor that cannot be read or shut is skipped.
"""

import os
import socket
import threading

# inodes of this process's sockets when `import ductile` ran under the
# agent (one entry, once noted)
_baseline: list[frozenset[int]] = []

_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN = "0A"  # /proc/net/tcp's state of a listening socket


def socket_inodes() -> frozenset[int]:
    """The inodes of this process's sockets (empty without /proc)."""
    found = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return frozenset()
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile, or the listing's own descriptor
        if link.startswith("socket:[") and link.endswith("]"):
            found.add(int(link[8:-1]))
    return frozenset(found)


def note_baseline() -> None:
    """Remembers the sockets there are before the script makes its group."""
    _baseline[:] = [socket_inodes()]


def baseline() -> frozenset[int] | None:
    """The sockets note_baseline() found; None when it did not run."""
    return _baseline[0] if _baseline else None


def _connected() -> dict[int, int]:
    """inode -> remote port of every TCP socket of this network namespace
    that is not listening."""
    out = {}
    for table in _TCP_TABLES:
        try:
            with open(table, encoding="ascii", errors="replace") as f:
                next(f, None)  # the header
                for line in f:
                    fields = line.split()
                    if len(fields) < 10 or fields[3] == _LISTEN:
                        continue
                    try:
                        out[int(fields[9])] = int(fields[2].rpartition(":")[2], 16)
                    except ValueError:
                        continue
        except OSError:
            continue
    return out


def made_since(before: frozenset[int] | None, skip_port: int | None = None) -> frozenset[int]:
    """The inodes of this process's TCP connections opened since `before`
    (none when `before` is None), less those to `skip_port`."""
    if before is None:
        return frozenset()
    new = socket_inodes() - before
    if not new:
        return frozenset()
    connected = _connected()
    return frozenset(i for i in new if i in connected and connected[i] != skip_port)


class Connections:
    """A process group's connections (`inodes`), of round `round`."""

    def __init__(self, round_: int, inodes: frozenset[int]):
        self.round = round_
        self.inodes = inodes
        self._lock = threading.Lock()
        self._retired = not inodes

    @property
    def retired(self) -> bool:
        return self._retired

    def retire(self) -> None:
        """The group is being left by its owner: never shut after this."""
        with self._lock:
            self._retired = True

    def shut(self) -> int:
        """Shuts both directions of every connection still open (once);
        returns how many were shut."""
        with self._lock:
            if self._retired:
                return 0
            self._retired = True
            shut = 0
            try:
                names = os.listdir("/proc/self/fd")
            except OSError:
                return 0
            for name in names:
                try:
                    fd = int(name)
                    link = os.readlink(f"/proc/self/fd/{name}")
                except (OSError, ValueError):
                    continue
                if not (link.startswith("socket:[") and int(link[8:-1]) in self.inodes):
                    continue
                try:
                    copy = os.dup(fd)
                except OSError:
                    continue
                try:
                    # The copy is ours: checked to be the same socket after
                    # the listing (its number may have been reused meanwhile).
                    if os.fstat(copy).st_ino in self.inodes:
                        sock = socket.socket(fileno=copy)
                        copy = -1  # the socket object's now
                        try:
                            sock.shutdown(socket.SHUT_RDWR)
                            shut += 1
                        finally:
                            sock.close()
                except OSError:
                    pass  # closed by the peer already, or not a connection
                finally:
                    if copy >= 0:
                        os.close(copy)
            return shut
