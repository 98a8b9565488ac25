#!/bin/sh
# torchrun_contract.py for command lines with --no-python: a worker that is
# not a Python script, run as it is.
exec python3 "$(dirname "$0")/torchrun_contract.py" "$@"
