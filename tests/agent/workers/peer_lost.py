"""Worker of the agent tests: all-reduces over the round's workers (gloo)
every 50 ms and raises ductile.CommunicationError when a peer is gone, as
ductile's collectives do. A worker of a round after the first says so and
exits 0.

usage: peer_lost.py
"""
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import ductile


def main():
    rank, round_ = int(os.environ["RANK"]), os.environ["DUCTILE_ROUND"]
    if round_ != "1":
        print(f"peer_lost round={round_} rank={rank} done", flush=True)
        return
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    print(f"peer_lost round={round_} rank={rank} started", flush=True)
    tensor = torch.ones(1)
    while True:
        try:
            dist.all_reduce(tensor)
        except RuntimeError as error:
            raise ductile.CommunicationError(f"all-reduce of round {round_}: {error}") from error
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
