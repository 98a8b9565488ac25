"""torch's TCPStore client against two servers: the one at HOST:PORT (an
agent's StoreServer) and torch's own (started here), the same operations on
both; prints each operation's answers and exits 1 when they differ.

usage: tcpstore_ops.py HOST PORT
"""
import datetime
import json
import sys
import threading
import time

import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=20)


def run(host, port):
    """Every operation of the client, with what each answered."""
    out = {}
    a = dist.TCPStore(host, port, world_size=None, is_master=False, timeout=TIMEOUT)
    b = dist.TCPStore(host, port, world_size=None, is_master=False, timeout=TIMEOUT)

    a.set("key", "value")
    out["get"] = a.get("key").decode()
    out["get binary"] = list(a.get("key") + b"")
    a.set("bytes", bytes(range(256)))
    out["binary"] = list(b.get("bytes"))
    out["add"] = [a.add("counter", 5), b.add("counter", -2), a.add("counter", 0)]
    out["counter text"] = a.get("counter").decode()
    out["compare_set new"] = a.compare_set("cs", "", "first").decode()
    out["compare_set wrong"] = a.compare_set("cs", "nope", "second").decode()
    out["compare_set right"] = b.compare_set("cs", "first", "second").decode()
    out["compare_set missing"] = a.compare_set("cs-missing", "expected", "x").decode()
    out["check"] = [a.check(["key", "counter"]), a.check(["key", "absent"])]
    out["delete"] = [a.delete_key("key"), a.delete_key("key")]
    # SET, APPEND and QUEUE_PUSH have no answer, so the order of two
    # connections' requests is the server's (torch's too): the writer makes
    # a round trip before the other client reads what it wrote.
    a.append("appended", "ab")
    b.append("appended", "cd")
    b.check(["appended"])
    out["append"] = a.get("appended").decode()
    a.multi_set(["m1", "m2"], ["one", "two"])
    out["multi_get"] = [v.decode() for v in b.multi_get(["m1", "m2", "counter"])]

    # WAIT answered by another client's SET, and a WAIT that times out
    # (the client cancels it) on a connection that works on afterwards.
    def later():
        time.sleep(0.3)
        b.set("late", "here")

    waker = threading.Thread(target=later)
    waker.start()
    a.wait(["late", "m1"])
    waker.join()
    out["wait"] = a.get("late").decode()
    try:
        a.wait(["never"], datetime.timedelta(milliseconds=200))
        out["wait timeout"] = "no timeout"
    except Exception as e:  # DistStoreError
        out["wait timeout"] = type(e).__name__
    out["after timeout"] = a.get("m2").decode()

    # Queues: a pop that waits for a push.
    b.queue_push("q", "first")
    b.queue_push("q", "second")
    b.queue_len("q")
    out["queue_len"] = a.queue_len("q")
    out["queue_pop"] = [a.queue_pop("q").decode(), a.queue_pop("q", block=False).decode()]

    def push():
        time.sleep(0.3)
        b.queue_push("q", "third")

    pusher = threading.Thread(target=push)
    pusher.start()
    out["queue_pop waits"] = a.queue_pop("q").decode()
    pusher.join()
    out["queue_len empty"] = a.queue_len("q")

    # A barrier of two clients.
    results = []
    other = threading.Thread(target=lambda: results.append(b.barrier("bar", 2)))
    other.start()
    time.sleep(0.2)
    a.barrier("bar", 2)
    other.join()
    out["num_keys"] = a.num_keys()
    out["list_keys"] = sorted(a.list_keys())
    out["clone"] = a.clone().get("m1").decode()
    return out


def main():
    host, port = sys.argv[1], int(sys.argv[2])
    theirs = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, timeout=TIMEOUT)
    expected = run("127.0.0.1", theirs.port)
    got = run(host, port)
    ok = True
    for op in expected:
        same = expected[op] == got.get(op)
        ok &= same
        print(f"{'ok' if same else 'DIFFERS'} {op}: {json.dumps(got.get(op))}"
              + ("" if same else f" (torch's server: {json.dumps(expected[op])})"), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
