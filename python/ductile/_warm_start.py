"""A spare worker of ``ductile agent --warm-workers``:
``python [OPTIONS] -P -m ductile._warm_start FD MODULES PATH0 [PROGRAM]``.

The agent starts one per local rank ahead of the next round, with the
worker's environment less the round's variables. It imports MODULES (torch
and torch._dynamo by default) and, when PROGRAM (the script, or -m MODULE)
is given, the modules the program imports at its top level, read from its
source without running it (see _program_imports); then it writes b"R"
(ready) to FD, its end of a
socket pair, and waits there for ONE launch record: the worker's stdout and
stderr as descriptors, then NUL-terminated fields: a version tag, the
working directory, the number of program words, the program words (a
script, or -m MODULE, and its arguments) and the whole environment. It then
becomes that worker as ``python [OPTIONS] PROGRAM`` would have started:
the same argv, environment, working directory, sys.path[0], ``__main__``,
output descriptors and exit status. A record that does not parse ends it
with status 2 and a message.

It runs with -P, so that the agent's working directory is not on sys.path
while it imports ahead (a torch/ planted there is not the job's). PATH0 is
"script-path" when the job's own Python puts the script's folder (or, for
-m, the working directory) first on sys.path, as the worker gets it here;
"safe-path" when that Python runs with a safe path too (-P, -I,
PYTHONSAFEPATH).
"""

import ast
import builtins
import importlib
import importlib.machinery
import importlib.util
import io
import os
import runpy
import socket
import sys
import types

_TAG = b"ductile-warm-start-1"
# As the agent's kMaxLaunchRecordBytes (workers.hpp).
_MAX_RECORD_BYTES = 4 << 20
# Once the record starts, the rest comes at once: the agent writes it in one go.
_REST_TIMEOUT_S = 30.0


# The longest program source read for its imports (a script is far shorter).
_MAX_SOURCE_BYTES = 4 << 20


class _BadRecord(Exception):
    pass


def _program_source(program, path0):
    """The source file `program` (a script, or ["-m", MODULE]) runs, and the
    folder the job's Python puts first on sys.path for it (None with a safe
    path); (None, folder) when the source is not found."""
    if program[0] != "-m":
        script = program[0]
        return script, (os.path.dirname(os.path.realpath(script)) if path0 else None)
    module = program[1]
    folder = os.getcwd() if path0 else None
    if folder is not None:
        base = os.path.join(folder, *module.split("."))
        for candidate in (base + ".py", os.path.join(base, "__main__.py")):
            if os.path.isfile(candidate):
                return candidate, folder
        if _shadowed(module, folder):
            return None, folder  # the working directory's, not readable here
    try:
        # An installed module (its parent packages are imported, as the
        # worker's `python -m` imports them).
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(module + ".__main__")
    except (ImportError, ValueError):
        return None, folder
    origin = spec.origin if spec is not None else None
    return (origin if origin and origin.endswith(".py") else None), folder


def _shadowed(name, folder):
    """True when `folder` (the job's sys.path[0]) holds a module or package
    of `name`'s top-level name: the job imports that one, which the spare,
    under -P, cannot see."""
    top = name.partition(".")[0]
    try:
        entries = os.listdir(folder)
    except OSError:
        return True  # unknown: nothing of it is imported ahead
    return any(entry == top or entry.startswith(top + ".") for entry in entries)


def _program_imports(program, path0):
    """The absolute imports of the program's top level (and of the ifs,
    trys and withs there; not of functions or classes), in order: what the
    worker imports first; `from a import b` gives a and a.b. Those its
    folder on sys.path would give it are left out (the job's own modules:
    the spare imports only what the job's interpreter finds on the path
    both share), and so is the program's own module. Never runs the
    program; [] when its source cannot be read or parsed."""
    source, folder = _program_source(program, path0)
    if source is None:
        return []
    try:
        with open(source, "rb") as f:
            tree = ast.parse(f.read(_MAX_SOURCE_BYTES + 1), source)
    except (OSError, SyntaxError, ValueError):
        return []
    found: list[str] = []
    pending = list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module and node.module != "__future__":
                found.append(node.module)
                # `from torch import nn`: a submodule, when it is one (an
                # attribute's name fails to import, and is passed over).
                found.extend(f"{node.module}.{alias.name}" for alias in node.names
                             if alias.name != "*")
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            inner = list(node.body) + list(getattr(node, "orelse", []))
            for handler in getattr(node, "handlers", []):
                inner.extend(handler.body)
            inner.extend(getattr(node, "finalbody", []))
            pending[:0] = inner
    own = program[1] if program[0] == "-m" else None
    names = []
    for name in found:
        if name in names or name == own or (folder is not None and _shadowed(name, folder)):
            continue
        names.append(name)
    return names


def _import_ahead(names):
    """Imports what it can of `names`: one that fails is the worker's to
    import (or to report), as it would have cold. A name that is no module
    but an attribute of its imported parent (`from transformers import
    AutoConfig`) is looked up: a package that loads its attributes lazily
    loads that one's module now."""
    for name in names:
        try:
            importlib.import_module(name)
            continue
        except (Exception, SystemExit):  # noqa: BLE001 - any failure: the worker imports it
            pass
        parent, _, attribute = name.rpartition(".")
        module = sys.modules.get(parent)
        if module is None:
            continue
        try:
            getattr(module, attribute)
        except (Exception, SystemExit):  # noqa: BLE001 - as above
            continue


def _read_record(fd):
    """Says the spare is ready, then returns the record's bytes and the
    descriptors sent with them; waits for the agent (the spare's guard's
    parent, whose end kills the spare) as long as it takes."""
    with socket.socket(fileno=fd) as channel:
        channel.sendall(b"R")
        data, fds, _, _ = socket.recv_fds(channel, 65536, 2)
        if len(fds) != 2:
            for received in fds:
                os.close(received)
            raise _BadRecord(f"{len(fds)} descriptors came with it, not 2 (stdout, stderr)")
        channel.settimeout(_REST_TIMEOUT_S)
        chunks = [data]
        size = len(data)
        while data:
            try:
                data = channel.recv(65536)
            except TimeoutError:
                raise _BadRecord(f"it did not end within {_REST_TIMEOUT_S:g} s") from None
            size += len(data)
            if size > _MAX_RECORD_BYTES:
                raise _BadRecord(f"it is longer than {_MAX_RECORD_BYTES} bytes")
            chunks.append(data)
    return b"".join(chunks), fds


def _parse(record):
    """(working directory, program words, environment) of a record."""
    fields = record.split(b"\0")
    if len(fields) < 4 or fields[-1] != b"" or fields[0] != _TAG:
        raise _BadRecord(f"it does not start with {_TAG.decode()} or lacks its fields")
    fields.pop()
    cwd = os.fsdecode(fields[1])
    if not fields[2].isdigit() or int(fields[2]) < 1 or 3 + int(fields[2]) > len(fields):
        raise _BadRecord(f"its program word count {fields[2][:20]!r} is not 1 to "
                         f"{len(fields) - 3}")
    end = 3 + int(fields[2])
    program = [os.fsdecode(word) for word in fields[3:end]]
    env = {}
    for entry in fields[end:]:
        name, eq, value = entry.partition(b"=")
        if not eq or not name:
            raise _BadRecord(f"its environment entry {entry[:40]!r} is not NAME=value")
        env[os.fsdecode(name)] = os.fsdecode(value)
    return cwd, program, env


def _take_streams(fds):
    """The round's stdout and stderr in place of /dev/null, buffered as the
    interpreter buffers them for what they are (a terminal: by line)."""
    for fd, target in zip(fds, (1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    for stream, target in ((sys.stdout, 1), (sys.stderr, 2)):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=not stream.write_through
                               and (target == 2 or os.isatty(target)))


def _run(program, path0):
    """Runs the program as ``python PROGRAM`` does, in a fresh ``__main__``;
    `path0`: put the script's folder (or the working directory) first on
    sys.path, as the job's Python would."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __annotations__={})
    sys.modules["__main__"] = main
    if program[0].startswith("-m"):
        module = program[0][2:] or program[1]
        sys.argv = ["-m"] + program[1 if program[0] != "-m" else 2:]
        if path0:
            sys.path.insert(0, os.getcwd())
        # What `python -m` calls (runpy has no public equivalent: run_module
        # runs in a temporary module, not in __main__).
        runpy._run_module_as_main(module, True)  # type: ignore[attr-defined]
        return
    script = program[0]
    sys.argv = list(program)
    if path0:
        sys.path.insert(0, os.path.dirname(os.path.realpath(script)))
    path = os.path.abspath(script)
    try:
        with open(path, "rb") as source:
            text = source.read()
    except OSError as e:
        # The interpreter's own message and status for a script it cannot open.
        print(f"{sys.executable}: can't open file {path!r}: [Errno {e.errno}] {e.strerror}",
              file=sys.stderr, flush=True)
        sys.exit(2)
    code = compile(text, path, "exec")
    main.__dict__.update(__file__=path, __cached__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    exec(code, main.__dict__)


def main():
    fd = int(sys.argv[1])
    path0 = sys.argv[3] != "safe-path"
    for name in sys.argv[2].split(","):
        importlib.import_module(name)
    if len(sys.argv) > 4:
        _import_ahead(_program_imports(sys.argv[4:], path0))
    try:
        record, fds = _read_record(fd)
        _take_streams(fds)
        cwd, program, env = _parse(record)
    except (_BadRecord, OSError, ValueError) as e:
        print(f"ductile: error: the launch record of a spare worker is invalid: {e}",
              file=sys.stderr, flush=True)
        sys.exit(2)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    try:
        _run(program, path0)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as error:  # noqa: BLE001 - the interpreter's own handling, below
        # As the interpreter shows an uncaught exception: without this
        # module's frames, then exit status 1.
        traceback = error.__traceback__
        while traceback and traceback.tb_frame.f_code.co_filename == __file__:
            traceback = traceback.tb_next
        sys.excepthook(type(error), error.with_traceback(traceback), traceback)
        sys.exit(1)


if __name__ == "__main__":
    main()
