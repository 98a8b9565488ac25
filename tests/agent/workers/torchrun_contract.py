"""Worker of the agent tests, under torchrun or under `ductile agent` alike:
writes its environment, interpreter and arguments as JSON to
$CONTRACT_OUT/<RANK>.json and says so on stdout and stderr.

$CONTRACT_WORLD: a world of another size is a round that will be re-formed
(an elastic job still gathering nodes): the worker waits to be stopped and
writes nothing.
--store: joins the group through torch's env:// rendezvous (gloo), runs an
all-reduce, and uses the workers' TCPStore at MASTER_ADDR:MASTER_PORT as a
client when TORCHELASTIC_USE_AGENT_STORE=True says the agent serves it;
what each step answered goes to $CONTRACT_OUT/<RANK>.store.json.
--fail-rank R: raises on rank R inside torch's @record, which writes the
exception to TORCHELASTIC_ERROR_FILE for the agent to report.

torch is imported only for --store and --fail-rank; other arguments are the
command line's own (a training script's options).
"""
import json
import os
import sys
import time


def write(path, value):
    with open(path + ".part", "w") as f:
        json.dump(value, f, indent=1, sort_keys=True)
    os.replace(path + ".part", path)


def use_the_store(out, rank):
    import datetime

    import torch
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", timeout=timeout)  # env://
    world = dist.get_world_size()
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    results = {"world": world, "all_reduce": t.item()}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=timeout)
        keys = [f"contract/{r}" for r in range(world)]
        store.set(keys[rank], str(rank))
        store.add("contract/count", 1)
        store.wait(keys)
        results["values"] = [v.decode() for v in store.multi_get(keys)]
        results["first"] = store.compare_set("contract/first", "", "taken").decode()
        dist.barrier()
        results["count"] = int(store.get("contract/count"))
        results["check"] = store.check(keys + ["contract/count", "contract/first"])
    dist.barrier()
    dist.destroy_process_group()
    write(os.path.join(out, f"{rank}.store.json"), results)


def main():
    out = os.environ["CONTRACT_OUT"]
    rank = os.environ["RANK"]
    expected = os.environ.get("CONTRACT_WORLD")
    if expected and os.environ["WORLD_SIZE"] != expected:
        while True:
            time.sleep(1)
    write(os.path.join(out, f"{rank}.json"),
          dict(os.environ, _executable=sys.executable, _argv=json.dumps(sys.argv[1:])))
    # One write a line: the ranks share the launcher's console, and print()
    # under PYTHONUNBUFFERED writes the text and its newline apart, so two
    # ranks' lines could interleave ("dumped rank 0dumped rank 1").
    os.write(1, f"dumped rank {rank}\n".encode())
    os.write(2, f"noted rank {rank}\n".encode())
    if "--store" in sys.argv:
        use_the_store(out, int(rank))
    if "--fail-rank" in sys.argv and sys.argv[sys.argv.index("--fail-rank") + 1] == rank:
        raise ValueError(f"boom from rank {rank}")


if __name__ == "__main__":
    if "--fail-rank" in sys.argv:
        from torch.distributed.elastic.multiprocessing.errors import record

        main = record(main)
    main()
