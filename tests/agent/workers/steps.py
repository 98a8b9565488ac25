"""Worker of the agent tests: a job of numbered steps, one every 0.1 s.
Rank 0 appends each step to OUT/steps.log; every rank runs until STOP
exists.

Without --on-request the log is also the checkpoint: a run resumes after
the last step logged (one short O_APPEND write per step, so a step is logged
whole or not at all). With --on-request the checkpoint is OUT/checkpoint,
written only when the agent asks (DUCTILE_CHECKPOINT_REQUEST, see
ductile.torch.elastic), after which each worker tells the agent it saved
(DUCTILE_CHECKPOINT_SAVED) and exits: steps trained since a checkpoint
would be trained again after a re-form that did not ask.

usage: steps.py OUT STOP [--on-request]
"""
import os
import sys
import time


def main():
    out, stop = sys.argv[1], sys.argv[2]
    on_request = "--on-request" in sys.argv[3:]
    env = os.environ
    rank = int(env["RANK"])
    log_path = os.path.join(out, "steps.log")
    checkpoint = os.path.join(out, "checkpoint")
    step = 0
    if on_request:
        if os.path.exists(checkpoint):
            with open(checkpoint) as f:
                step = int(f.read())
    elif os.path.exists(log_path):
        with open(log_path) as f:
            lines = f.read().split()
        if lines:
            step = int(lines[-2]) + 1
    if rank == 0:
        # One write with its newline (print under PYTHONUNBUFFERED writes the
        # newline apart): the ranks share the agent's console, and the test
        # reads the step at the line's end.
        sys.stdout.write(f"start round={env['DUCTILE_ROUND']} world={env['WORLD_SIZE']} "
                         f"at step {step}\n")
        sys.stdout.flush()
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    while not os.path.exists(stop):
        time.sleep(0.1)
        if rank == 0:
            os.write(log, f"{step} {env['DUCTILE_ROUND']}\n".encode())
        step += 1
        request = env.get("DUCTILE_CHECKPOINT_REQUEST")
        if on_request and request and os.path.exists(request):
            # No collective here: each rank stops at the first step it sees
            # the request; rank 0's step is the checkpoint.
            if rank == 0:
                with open(checkpoint + ".part", "w") as f:
                    f.write(str(step))
                os.replace(checkpoint + ".part", checkpoint)
            saved = env["DUCTILE_CHECKPOINT_SAVED"]
            with open(saved + ".part", "w") as f:
                f.write("saved")
            os.replace(saved + ".part", saved)
            print(f"saved round={env['DUCTILE_ROUND']} rank={rank} at step {step}", flush=True)
            break
    os.close(log)


if __name__ == "__main__":
    main()
