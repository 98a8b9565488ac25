"""Worker of the agent tests: writes its environment as JSON to
OUT.<RANK>.json, under torchrun or under `ductile agent` alike, and with
--fail-rank R raises on rank R inside torch's @record, which writes the
exception to TORCHELASTIC_ERROR_FILE for the agent to report.

usage: torchrun_contract.py OUT [--fail-rank R]
"""
import json
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record


@record
def main():
    out = sys.argv[1]
    rank = os.environ["RANK"]
    with open(f"{out}.{rank}.json.part", "w") as f:
        json.dump(dict(os.environ), f, indent=1, sort_keys=True)
    os.replace(f"{out}.{rank}.json.part", f"{out}.{rank}.json")
    if "--fail-rank" in sys.argv and sys.argv[sys.argv.index("--fail-rank") + 1] == rank:
        raise ValueError(f"boom from rank {rank}")


if __name__ == "__main__":
    main()
