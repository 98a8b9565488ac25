"""Worker of the agent's etcd cluster test: a job of numbered steps. Rank 0
appends each step to OUT/steps.log, which is also the checkpoint: a run
resumes after the last step logged (one short O_APPEND write per step, so a
step is logged whole or not at all). Every rank runs until STOP exists.

usage: steps.py OUT STOP
"""
import os
import sys
import time


def main():
    out, stop = sys.argv[1], sys.argv[2]
    env = os.environ
    rank = int(env["RANK"])
    log_path = os.path.join(out, "steps.log")
    step = 0
    if os.path.exists(log_path):
        with open(log_path) as f:
            lines = f.read().split()
        if lines:
            step = int(lines[-2]) + 1
    if rank == 0:
        print(f"start round={env['DUCTILE_ROUND']} world={env['WORLD_SIZE']} at step {step}",
              flush=True)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    while not os.path.exists(stop):
        time.sleep(0.1)
        if rank == 0:
            os.write(log, f"{step} {env['DUCTILE_ROUND']}\n".encode())
            step += 1
    os.close(log)


if __name__ == "__main__":
    main()
