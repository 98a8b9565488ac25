"""Worker of the agent's host tests: the round's workers meet over TCP at
MASTER_ADDR:MASTER_PORT (traffic between network namespaces), then each
appends a heartbeat (time.time_ns) to OUT/beat.<node>.<round>.<rank> every
20 ms until STOP exists. Where the agent serves the workers' store there
(TORCHELASTIC_USE_AGENT_STORE=True, as torchrun's does), they meet in it
with torch's TCPStore client; else rank 0 listens on the port itself.

usage: beat.py OUT STOP
"""
import os
import socket
import sys
import time


def meet_in_agent_store(rank, world, addr, port):
    from datetime import timedelta

    from torch.distributed import TCPStore
    store = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=120))
    store.set(f"beat/met/{rank}", str(rank))
    if rank != 0:
        return None
    keys = [f"beat/met/{r}" for r in range(world)]
    store.wait(keys)
    return sorted(int(store.get(key)) for key in keys)


def meet(rank, world, addr, port):
    if world == 1:
        return [0]
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return meet_in_agent_store(rank, world, addr, port)
    if rank == 0:
        server = socket.create_server((addr, port))
        server.settimeout(120)
        ranks = [0]
        while len(ranks) < world:
            connection, _ = server.accept()
            with connection:
                ranks.append(int(connection.recv(16).decode()))
        server.close()
        return sorted(ranks)
    deadline = time.monotonic() + 120
    while True:
        try:
            with socket.create_connection((addr, port), timeout=5) as connection:
                connection.sendall(str(rank).encode())
                return None
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main():
    out, stop = sys.argv[1], sys.argv[2]
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    ranks = meet(rank, world, env["MASTER_ADDR"], int(env["MASTER_PORT"]))
    if ranks is not None:
        print(f"met round={env['DUCTILE_ROUND']} world={world} ranks={ranks} "
              f"at {env['MASTER_ADDR']}", flush=True)
    name = os.path.join(out, f"beat.{env['DUCTILE_AGENT_NODE_ID']}.{env['DUCTILE_ROUND']}.{rank}")
    with open(name, "a") as beats:
        while not os.path.exists(stop):
            beats.write(f"{time.time_ns()}\n")
            beats.flush()
            time.sleep(0.02)


if __name__ == "__main__":
    main()
