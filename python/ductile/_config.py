"""Loading a configuration: a ductile TOML or a DeepSpeed JSON config, given
as a file, a string or a Python dict.

A ductile TOML is validated against the selected plugins' schemas (errors as
``file:line:col: message``, every problem at once, as ``ductile config
check`` prints them). A DeepSpeed JSON config is read with DeepSpeed's keys
and defaults by the parts that use it (``elasticity``,
``data_efficiency.data_sampling.dynamic_batching``).
"""

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeAlias

from . import _ductile
from ._errors import ConfigError, Error, InvalidArgumentError, shown as _shown

Runtime = _ductile.Runtime

# A path argument: a str or an os.PathLike (pathlib.Path).
StrPath: TypeAlias = str | os.PathLike[str]
# A plugin_path argument: extra plugin directories, searched first (a list:
# a single path is refused, naming the argument).
PluginPath: TypeAlias = Iterable[StrPath] | None


class Config:
    """A loaded configuration.

    Attributes: ``format`` ("toml" or "deepspeed"), ``origin`` (file name or
    "<string>"/"<dict>"), ``runtime`` (the validated ductile runtime; for a
    DeepSpeed config one with no sections, used to find plugins),
    ``deepspeed`` (the JSON text of a DeepSpeed config, else None),
    ``base_dir`` (relative paths in the config resolve against it).
    """

    # runtime: a _ductile.Runtime (the extension has no stubs).
    def __init__(self, format: str, origin: str, runtime: Any, deepspeed: str | None = None,
                 base_dir: str = "") -> None:
        self.format = format
        self.origin = origin
        self.runtime = runtime
        self.deepspeed = deepspeed
        self.base_dir = base_dir
        # Makes the same runtime anew (its plugins' state is one world's: an
        # engine that rejoins a round in place needs a fresh one); None when
        # the configuration cannot be read again.
        self.fresh_runtime: Callable[[], Any] | None = None

    def __repr__(self) -> str:
        return f"ductile.Config(format={self.format!r}, origin={self.origin!r})"


def _toml_value(value, where):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v, where) for v in value) + "]"
    raise InvalidArgumentError(
        f"{where}: a value of type {type(value).__name__} ({value!r}) cannot be written to "
        "TOML; valid: bool, int, float, str, list")


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_key(key, where):
    """A key as TOML writes it: bare when it can be, else quoted."""
    if not isinstance(key, str):
        raise InvalidArgumentError(
            f"{where}: key {key!r} is a {type(key).__name__}; TOML keys are str")
    return key if _BARE_KEY.fullmatch(key) else json.dumps(key)


def toml_from_dict(config: Mapping[str, Any]) -> str:
    """TOML text for a dict of sections ({"elasticity": {"policy": "v0.1", ...}})."""
    lines = []
    for section, table in config.items():
        if not isinstance(table, dict):
            raise InvalidArgumentError(
                f"TOML config dict: section {section!r} must be a dict of keys, got "
                f"{type(table).__name__} ({_shown(table)})")
        name = _toml_key(section, "TOML config dict")
        lines.append(f"[{name}]")
        for key, value in table.items():
            where = f"[{section}] {key!r}"
            lines.append(f"{_toml_key(key, f'[{section}]')} = {_toml_value(value, where)}")
    return "\n".join(lines) + "\n"


def _json_of(config):
    """A DeepSpeed config dict as JSON text; ConfigError for one JSON cannot hold."""
    try:
        return json.dumps(config, allow_nan=False)
    except RecursionError as e:
        # Far deeper than the JSON reader takes: its limit, without the text.
        raise ConfigError(f"<dict>: JSON nested deeper than {_ductile.MAX_JSON_DEPTH} levels; "
                          f"ductile accepts at most {_ductile.MAX_JSON_DEPTH}") from e
    except (TypeError, ValueError) as e:
        raise ConfigError(f"<dict>: the DeepSpeed config cannot be written as JSON: {e}; "
                          "valid: dicts with str keys, lists, str, int, float (finite), bool, "
                          "None") from e


def _utf8_text(text):
    """Whether `text` can be UTF-8 (a lone surrogate cannot)."""
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _looks_like_json(text, path=""):
    return _ductile.elasticity.is_json_config(path, text)


def load_config(source: StrPath | dict[str, Any] | Config, *,
                format: Literal["toml", "deepspeed"] | None = None, plugin_path: PluginPath = None,
                allow_config_plugins: bool = False) -> Config:
    """Loads a ductile TOML or a DeepSpeed JSON configuration.

    ``source``: a path (str or os.PathLike) to a .toml or .json file (other
    extensions: JSON when the content starts with '{'), a TOML or JSON text
    (a str holding a newline, '=' or starting with '{'), a dict (a
    DeepSpeed config unless ``format="toml"``), or a loaded Config (returned
    as it is; a ConfigError when ``format`` names the other kind). ``format``:
    "toml", "deepspeed" or None (detect). ``plugin_path``: extra plugin directories,
    searched before DUCTILE_PLUGIN_PATH and the built-in ones.
    ``allow_config_plugins``: also search the directories the
    configuration's own ``[plugins] path`` names, running the code of the
    plugins found there (off by default, as ``ductile config check`` needs
    ``--allow-config-plugins``: a configuration received from elsewhere is
    read, not run; a plugin it selects from there is a ConfigError naming
    the directory and this argument). A DeepSpeed config names no plugin
    directory.
    A DeepSpeed config with an elasticity block is checked by DeepSpeedConfig's
    rules for it (ductile.elasticity.deepspeed_config_plan).
    Raises ConfigError (file:line:col messages; ElasticityConfigError for
    those rules), NotFoundError.
    """
    if format not in (None, "toml", "deepspeed"):
        raise InvalidArgumentError(
            f"format {format!r} is not valid; valid: 'toml', 'deepspeed' or None (detect)")
    if not isinstance(allow_config_plugins, bool):
        raise InvalidArgumentError(
            f"allow_config_plugins = {_shown(allow_config_plugins)} is not a bool; give True "
            "or False")
    if plugin_path is not None and not isinstance(plugin_path, (str, bytes, os.PathLike)):
        # Read again by Config.fresh_runtime: an iterator is taken once. What
        # is not a list of paths is refused where the path is read, named.
        with contextlib.suppress(TypeError):
            plugin_path = list(plugin_path)
    if isinstance(source, Config):
        if format is not None and source.format != format:
            # Its readers take the DeepSpeed JSON text of a "deepspeed" one,
            # the validated sections of a "toml" one: the other kind has none.
            raise ConfigError(
                f"config: {source.origin} is a loaded {source.format} config, but "
                f"format={format!r} was asked for; valid: a {format} config (path, text, dict or "
                f"a ductile.Config of format {format!r})")
        return source
    if isinstance(source, dict):
        if format == "toml":
            text = toml_from_dict(source)
            return _toml_config("<dict>", lambda: Runtime.from_toml(
                text, "<dict>", plugin_path, allow_config_plugins))
        return _deepspeed_config("<dict>", Runtime.plain(plugin_path), _json_of(source))
    is_path = isinstance(source, os.PathLike)
    if isinstance(source, str) and not _utf8_text(source):
        try:
            os.fsencode(source)  # a file name of bytes that are not UTF-8: a path
        except UnicodeEncodeError as e:
            raise ConfigError(
                f"config: the text or path holds a lone surrogate at index {e.start} "
                f"({source[e.start]!r}), which neither UTF-8 text nor a file name can hold") \
                from e
        is_path = True
    if is_path or (isinstance(source, str) and "\n" not in source and "=" not in source
                   and not _looks_like_json(source)):
        path = os.fspath(source)
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if "\0" in path:
            raise ConfigError(f"config: path {path!r} holds NUL, which no file name can hold")
        shown = path.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
        data = None
        if format != "toml":
            # One reader for every front end (core::read_user_file, as the
            # CLI's): a regular file of at most 16 MiB, a FIFO refused
            # without waiting for a writer, a device never read.
            try:
                data = _ductile.read_user_file(path, "configuration file")
            except Error:
                if format == "deepspeed" or _looks_like_json("", shown):
                    raise
                # A TOML by its name: Runtime.from_file reads it with the
                # same checks and reports the problem as the file's diagnostic.
        if data is not None and (format == "deepspeed" or _looks_like_json(data, shown)):
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"{shown}: the DeepSpeed config is not UTF-8 text (byte "
                                  f"{e.start})") from e
            return _deepspeed_config(shown, Runtime.plain(plugin_path), text,
                                     os.path.dirname(os.path.abspath(path)))
        config = _toml_config(path, lambda: Runtime.from_file(path, plugin_path,
                                                              allow_config_plugins))
        config.base_dir = config.runtime.base_dir
        return config
    if isinstance(source, str):
        if format == "deepspeed" or (format is None and _looks_like_json(source)):
            return _deepspeed_config("<string>", Runtime.plain(plugin_path), source, os.getcwd())
        text = source
        return _toml_config("<string>", lambda: Runtime.from_toml(text, "<string>", plugin_path,
                                                                  allow_config_plugins))
    raise InvalidArgumentError(
        f"config: expected a path, a TOML/JSON string or a dict, got {type(source).__name__}")


def _toml_config(origin, make):
    config = Config("toml", origin, make())
    config.fresh_runtime = make
    return config


def parse_json(text: str, origin: str) -> Any:
    """A DeepSpeed config's JSON text as Python objects, read by the CLI's
    reader: nesting of at most 64 levels, nothing after the value, each key
    once per object, a UTF-8 byte order mark skipped. ConfigError naming
    ``origin`` otherwise."""
    return _ductile.parse_json(text, origin)


def _deepspeed_config(origin, runtime, text, base_dir=""):
    """A DeepSpeed config, read as JSON by the CLI's rules and checked by
    DeepSpeedConfig's elasticity rules when it has an elasticity block (the
    world size aside); other errors are the reader's that uses it."""
    parsed = parse_json(text, origin)
    if isinstance(parsed, dict) and "elasticity" in parsed:
        _ductile.elasticity.deepspeed_mode(text, origin)
    return Config("deepspeed", origin, runtime, text, base_dir)


def plugins(kind: str | None = None, *, plugin_path: PluginPath = None) -> list[dict[str, Any]]:
    """The installed plugins (as ``ductile plugins list``): dicts with kind,
    name, version, description, file and params."""
    return Runtime.plain(plugin_path).plugins(kind)
