"""Exception classes of ductile.

Every error raised by the C++ core or a plugin arrives as one of these, with
the message the ``ductile`` CLI prints for the same input. The class is chosen
from the error's type name (for example ``ElasticityConfigError``), else from
its kind. Each class also derives from the closest built-in exception, so
``except ValueError`` keeps working for bad values and ``except OSError`` for
unreadable files.

Attributes of every instance: ``kind`` (the C++ ErrorKind name: ``config``,
``invalid_argument``, ...), ``type`` (the finer type name or ``""``),
``diagnostics`` (for configuration files: one ``file:line:col: message`` per
problem).
"""

import re
from collections.abc import Iterable

# What a terminal would act on rather than show (as core::printable escapes
# in C++): C0 controls but tab and newline, DEL, C1 controls, bidirectional
# controls, and the lone surrogates of file names that are not UTF-8.
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e"
                          "\u2066-\u2069\ud800-\udfff]")


def _escape(match):
    code = ord(match.group())
    if code < 0x80:
        return f"\\x{code:02x}"
    if 0xDC80 <= code <= 0xDCFF:  # a byte of a file name (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    return f"\\u{{{code:04x}}}"


def printable(text: str) -> str:
    """`text` with control and bidi characters, NUL and lone surrogates
    escaped (newlines and tabs kept)."""
    return _UNPRINTABLE.sub(_escape, text)


class Error(Exception):
    """Base class of every ductile error. The message is printable(): no
    character in it acts on a terminal."""

    kind: str = "internal"

    def __init__(self, message: object = "", *, kind: str | None = None, type: str = "",
                 diagnostics: Iterable[object] = ()) -> None:
        super().__init__(printable(str(message)))
        if kind is not None:
            self.kind = kind
        self.type = type
        self.diagnostics = [printable(str(d)) for d in diagnostics]


class InvalidArgumentError(Error, ValueError):
    """A bad value passed to a call."""

    kind = "invalid_argument"


class ConfigError(Error, ValueError):
    """A configuration file, string or dict is invalid."""

    kind = "config"


class NotFoundError(Error, LookupError):
    """A file, plugin or key does not exist."""

    kind = "not_found"


class PluginError(Error):
    """A plugin could not be loaded or created."""

    kind = "plugin"


class IoError(Error, OSError):
    """A file could not be read or written, or is corrupt."""

    kind = "io"


class IncompatibleError(Error):
    """A valid request that the current state cannot satisfy."""

    kind = "incompatible"


class CommunicationError(Error):
    kind = "communication"


class UnsupportedError(Error):
    kind = "unsupported"


class InternalError(Error):
    """A broken invariant: a bug in ductile or a plugin."""

    kind = "internal"


# DeepSpeed's elasticity exceptions (deepspeed.elasticity.config), with the
# same hierarchy: both specific errors derive from ElasticityError.
class ElasticityError(Error):
    """Base of the elasticity errors (DeepSpeed's ElasticityError)."""

    kind = "incompatible"


class ElasticityConfigError(ElasticityError, ConfigError):
    """Invalid elasticity settings (DeepSpeed's ElasticityConfigError)."""

    kind = "config"


class ElasticityIncompatibleWorldSize(ElasticityError, IncompatibleError):
    """The world size is not valid for the configuration."""

    kind = "incompatible"


class NotEnoughSamplesError(IncompatibleError):
    """The samples cannot fill one micro-batch per slot of a step."""


_BY_KIND = {
    "invalid_argument": InvalidArgumentError,
    "config": ConfigError,
    "not_found": NotFoundError,
    "plugin": PluginError,
    "io": IoError,
    "incompatible": IncompatibleError,
    "communication": CommunicationError,
    "unsupported": UnsupportedError,
    "internal": InternalError,
}

_BY_TYPE = {
    "ElasticityError": ElasticityError,
    "ElasticityConfigError": ElasticityConfigError,
    "ElasticityIncompatibleWorldSize": ElasticityIncompatibleWorldSize,
    "NotEnoughSamples": NotEnoughSamplesError,
}


def from_native(kind: str, type_name: str, message: str,
                diagnostics: Iterable[object] = ()) -> Error:
    """The exception instance for a C++ ductile::Error (used by _ductile)."""
    return error_class(kind, type_name)(message, kind=kind, type=type_name,
                                        diagnostics=diagnostics)


def error_class(kind: str, type_name: str = "") -> type[Error]:
    """The class from_native would pick."""
    return _BY_TYPE.get(type_name) or _BY_KIND.get(kind, InternalError)


def shown(value: object) -> str:
    """repr(value) for a message, cut after 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


__all__ = [
    "Error", "InvalidArgumentError", "ConfigError", "NotFoundError", "PluginError", "IoError",
    "IncompatibleError", "CommunicationError", "UnsupportedError", "InternalError",
    "ElasticityError", "ElasticityConfigError", "ElasticityIncompatibleWorldSize",
    "NotEnoughSamplesError",
]
