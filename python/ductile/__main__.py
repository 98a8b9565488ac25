"""``python -m ductile ARGS``, and the ``ductile`` command a pip install puts
on PATH: replaces this process with the C++ CLI that lives inside the
package (``ductile/bin/ductile``; in a CMake build tree, ``<build>/bin/ductile``),
so exit codes, output and signals are the CLI's own."""

import os
import sys


def cli_path():
    """The path of the ``ductile`` executable that belongs to this package."""
    package = os.path.dirname(os.path.abspath(__file__))
    for candidate in (os.path.join(package, "bin", "ductile"),
                      os.path.join(package, os.pardir, os.pardir, "bin", "ductile")):
        if os.access(candidate, os.X_OK):
            return os.path.normpath(candidate)
    raise FileNotFoundError(
        f"the ductile CLI is missing from this installation: looked for "
        f"{os.path.join(package, 'bin', 'ductile')} (pip install) and "
        f"{os.path.normpath(os.path.join(package, os.pardir, os.pardir, 'bin', 'ductile'))} "
        "(CMake build tree); reinstall the package")


def main():
    try:
        executable = cli_path()
    except FileNotFoundError as e:
        print(f"ductile: error: {e}", file=sys.stderr)
        return 1
    # `ductile agent` runs a Python training script under this interpreter,
    # as torchrun runs it under its own (PYTHON_EXEC still comes first).
    os.environ["DUCTILE_CONSOLE_PYTHON"] = sys.executable
    os.execv(executable, ["ductile", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
