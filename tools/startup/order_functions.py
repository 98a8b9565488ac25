#!/usr/bin/env python3
"""Lists the functions that the `ductile` program and the built-in plugins run
at start-up, for sdk/static_runtime/startup_functions.txt.

The link places the functions of that list together at the front of the text
of the program and of every built-in plugin (sdk/static_runtime/CMakeLists.txt),
so that a start-up faults in a few 64 KB windows of text rather than nearly
all of them (docs/architecture.md, "Start-up").

It runs each command of the start-up benchmark (tests/benchmarks/startup/
commands.sh) once under valgrind's callgrind, and keeps the symbol names of the
functions that ran inside the program or a built-in plugin. Functions that
more commands run come first, then by name, so that the shortest commands
touch the fewest windows and the file changes little from one run to the next.

Usage: tools/startup/order_functions.py [--build DIR] [--output FILE]
The build must be a Release build with the static runtime (./run.sh makes
one in build/): the names are those its compiler gave the functions.
Rerun it when start-up changes (a new command on the path, another compiler)
and commit the file: a stale name matches nothing, and a function missing from
the list only stays where it was, so a stale list costs time, never behaviour.
Needs valgrind. Exits 2 for a missing program or tool.
"""
import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIST = os.path.join("sdk", "static_runtime", "startup_functions.txt")
# A symbol name, as a section name of the link holds it after ".text.".
# callgrind adds 'N to the N-th level of a recursion (stripped), and names
# code it cannot attribute "(below main)" or by its address (skipped).
SYMBOL = re.compile(r"^[A-Za-z_][A-Za-z0-9_.$]*$")
HEADER = """\
# The functions the `ductile` program and the built-in plugins run at
# start-up, by symbol name: the link places them at the front of each
# module's text (sdk/static_runtime/CMakeLists.txt). Written by
# tools/startup/order_functions.py from a Release build; rerun it rather than
# editing by hand. Functions run by more of the start-up benchmark's commands
# come first.
"""


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", default=os.path.join(ROOT, "build"),
                        help="a Release build with the static runtime (default: build)")
    parser.add_argument("--output", default=os.path.join(ROOT, LIST),
                        help=f"the list to write (default: {LIST})")
    return parser.parse_args()


def aliases(module):
    """Every name of each function of `module` (its symbol table), by name: a
    constructor's or destructor's complete and base-object symbols (C1, C2)
    share one body, and the section holding it is named after one of them,
    while callgrind names it after either."""
    addresses = collections.defaultdict(set)
    listing = subprocess.run(["nm", "--defined-only", module], check=True, capture_output=True,
                             text=True).stdout
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) == 3 and fields[1] in "tTwW":
            addresses[fields[0]].add(fields[2])
    return {name: names for names in addresses.values() for name in names}


def executed_functions(callgrind_out, modules):
    """The functions with cost in `callgrind_out` that lie in `modules`, a
    dict of module path to its aliases()."""
    objects, functions, found = {}, {}, set()
    current = None
    with open(callgrind_out) as f:
        for line in f:
            match = re.match(r"^(c?ob|c?fn)=\((\d+)\)(?: (.*))?$", line.rstrip("\n"))
            if not match:
                continue
            kind, number, name = match.groups()
            table = objects if kind.endswith("ob") else functions
            if name is not None:
                table[number] = name
            if kind == "ob":
                current = objects[number]
            elif kind == "fn" and (current in modules or current == "???"):
                symbol = re.sub(r"'\d+$", "", functions[number])
                if not SYMBOL.match(symbol):
                    continue
                # valgrind attributes the functions of an ordered build's
                # .text.ductile_startup to no object ("???"): it takes a
                # module's code to be its .text. They are ours if a module
                # defines them.
                for names in ([modules[current]] if current in modules else modules.values()):
                    found |= names.get(symbol, set())
    return found


def main():
    args = parse_args()
    program = os.path.join(args.build, "bin", "ductile")
    plugins = os.path.join(args.build, "lib", "ductile", "plugins")
    if not os.access(program, os.X_OK) or not os.path.isdir(plugins):
        fail(f"--build {args.build}: no bin/ductile and lib/ductile/plugins/ in it; give a "
             "Release build with the static runtime (./run.sh makes build/)")
    if shutil.which("valgrind") is None:
        fail("valgrind is not installed (apt-get install valgrind)")
    paths = {os.path.realpath(program)} | {
        os.path.realpath(os.path.join(plugins, f)) for f in os.listdir(plugins)
        if f.endswith(".so")}
    modules = {path: aliases(path) for path in paths}
    runs = collections.Counter()
    env = dict(os.environ, DUCTILE_LOG_LEVEL="error")
    with tempfile.TemporaryDirectory() as work:
        lines = subprocess.run(
            [os.path.join(ROOT, "tests", "benchmarks", "startup", "commands.sh"), work, program],
            check=True, capture_output=True, text=True).stdout.splitlines()
        for number, line in enumerate(lines):
            name, command = line.split("\t")
            out = os.path.join(work, f"callgrind.{number}")
            subprocess.run(["valgrind", "--tool=callgrind", "--demangle=no",
                            f"--callgrind-out-file={out}"] + command.split(),
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=env)
            functions = executed_functions(out, modules)
            runs.update(functions)
            print(f"{name}: {len(functions)} functions", file=sys.stderr)
    ordered = sorted(runs, key=lambda symbol: (-runs[symbol], symbol))
    with open(args.output, "w") as f:
        f.write(HEADER + "".join(f"{symbol}\n" for symbol in ordered))
    print(f"{len(ordered)} functions -> {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
