"""A path given as an argument, checked once at the edge: a str (or
os.PathLike) that a file name can be, else InvalidArgumentError naming the
argument."""

import os
from typing import Any

from ._errors import InvalidArgumentError


def path_argument(value: Any, name: str, where: str) -> str:
    """`value` as a str path. `name`: the argument's name, `where`: the call
    (for the message). Refuses what is not a path, and names no file can
    have (empty, holding NUL, or a lone surrogate that is not a byte of a
    file name)."""
    try:
        path = os.fspath(value)
    except TypeError as e:
        raise InvalidArgumentError(f"{where}: {name} = {value!r} is not a path (give a str or "
                                   "os.PathLike)") from e
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    try:
        encoded = os.fsencode(path)
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(f"{where}: {name} = {path!r} holds a lone surrogate, which no "
                                   "file name can hold") from e
    if not path or b"\0" in encoded:
        raise InvalidArgumentError(f"{where}: {name} = {path!r} is not a valid path (empty, or "
                                   "holding NUL)")
    return path
