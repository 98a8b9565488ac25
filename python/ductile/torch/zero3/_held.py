"""A worker held in a collective of a round its agent has replaced: a
thread shuts the round's connections, and the collective fails.

The engine's own waits on torch's works look at the round notice as they
poll (_world.superseded). Others cannot: the gathers the engine plans for
a pass wait in C++, and a training loop's own collectives (a Trainer's
gather of its token count) wait in torch. When a peer went silent
(SIGSTOP, a cut cable), or left for the new round while its old group
stayed open, such a wait would last until the group's timeout. This
thread (one per engine that takes notices, on the cpu) reads the notice
every _POLL_S seconds; once a newer round's notice has been there for
_GRACE_S and the training thread has not left the round itself, it shuts
the round's connections (ductile._round_sockets): the wait fails as when
a peer's process dies, and the engine recovers from that failure
(_rejoin.Recovery).

Threading: the thread holds the Recovery weakly and ends with it, or at
stop(); Connections' lock orders it against the training thread's
retire() (_rejoin._leave).
"""

import logging
import threading
import time
import weakref

from ... import _round_sockets
from ..._errors import Error
from ._round_notice import NoticeWatch

_log = logging.getLogger("ductile.zero3")

_POLL_S = 0.02
# How long a newer notice is left to the training thread, which leaves the
# round itself when it is in a wait it polls, or between collectives.
_GRACE_S = 0.05


class HeldWatch:
    """Starts the thread for `recovery` (its `connections` and `watch`)."""

    def __init__(self, recovery):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(weakref.ref(recovery),),
                                        name="ductile-zero3-held", daemon=True)
        self._thread.start()

    def stop(self):
        self._stop.set()

    def _run(self, ref):
        watch = None
        seen_since = None  # when the newer notice was first seen
        while not self._stop.wait(_POLL_S):
            recovery = ref()
            if recovery is None:
                return
            connections = recovery.connections
            if watch is None:
                watch = NoticeWatch(recovery.watch.path, 0)
            del recovery
            if connections is None or connections.retired:
                seen_since = None
                continue
            watch.round = connections.round
            try:
                notice = watch.newer()
            except Error:
                notice = None  # the training thread reports an unreadable notice
            if notice is None:
                seen_since = None
                continue
            now = time.monotonic()
            if seen_since is None:
                seen_since = now
            if now - seen_since < _GRACE_S:
                continue
            count = connections.shut()
            if count:
                _log.warning("zero3: round %d's notice came while this worker waited in a "
                             "collective of round %d (a silent peer, or one that left, holds "
                             "it): its %d connection(s) to that round's workers were shut",
                             notice.round, connections.round, count)


def connections_of(round_, before, skip_port=None):
    """The Connections of a group made since `before` (see _round_sockets)."""
    return _round_sockets.Connections(round_, _round_sockets.made_since(before, skip_port))
