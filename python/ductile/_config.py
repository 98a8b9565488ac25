"""Loading a configuration: a ductile TOML or a DeepSpeed JSON config, given
as a file, a string or a Python dict.

A ductile TOML is validated against the selected plugins' schemas (errors as
``file:line:col: message``, every problem at once, as ``ductile config
check`` prints them). A DeepSpeed JSON config is read with DeepSpeed's keys
and defaults by the parts that use it (``elasticity``,
``data_efficiency.data_sampling.dynamic_batching``).
"""

import json
import os

from . import _ductile
from ._errors import ConfigError, InvalidArgumentError

Runtime = _ductile.Runtime


class Config:
    """A loaded configuration.

    Attributes: ``format`` ("toml" or "deepspeed"), ``origin`` (file name or
    "<string>"/"<dict>"), ``runtime`` (the validated ductile runtime; for a
    DeepSpeed config one with no sections, used to find plugins),
    ``deepspeed`` (the JSON text of a DeepSpeed config, else None),
    ``base_dir`` (relative paths in the config resolve against it).
    """

    def __init__(self, format, origin, runtime, deepspeed=None, base_dir=""):
        self.format = format
        self.origin = origin
        self.runtime = runtime
        self.deepspeed = deepspeed
        self.base_dir = base_dir

    def __repr__(self):
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


def toml_from_dict(config):
    """TOML text for a dict of sections ({"elasticity": {"policy": "v0.1", ...}})."""
    lines = []
    for section, table in config.items():
        if not isinstance(table, dict):
            raise InvalidArgumentError(
                f"TOML config dict: section '{section}' must be a dict of keys, got "
                f"{type(table).__name__} ({table!r})")
        lines.append(f"[{section}]")
        for key, value in table.items():
            lines.append(f"{key} = {_toml_value(value, f'[{section}] {key}')}")
    return "\n".join(lines) + "\n"


def _looks_like_json(text, path=""):
    return _ductile.elasticity.is_json_config(path, text)


def load_config(source, *, format=None, plugin_path=None):
    """Loads a ductile TOML or a DeepSpeed JSON configuration.

    ``source``: a path (str or os.PathLike) to a .toml or .json file (other
    extensions: JSON when the content starts with '{'), a TOML or JSON text
    (a str holding a newline, '=' or starting with '{'), or a dict (a
    DeepSpeed config unless ``format="toml"``). ``format``: "toml",
    "deepspeed" or None (detect). ``plugin_path``: extra plugin directories,
    searched before DUCTILE_PLUGIN_PATH and the built-in ones.
    Raises ConfigError (file:line:col messages), NotFoundError.
    """
    if format not in (None, "toml", "deepspeed"):
        raise InvalidArgumentError(
            f"format '{format}' is not valid; valid: 'toml', 'deepspeed' or None (detect)")
    if isinstance(source, Config):
        return source
    if isinstance(source, dict):
        if format == "toml":
            return Config("toml", "<dict>",
                          Runtime.from_toml(toml_from_dict(source), "<dict>", plugin_path))
        return Config("deepspeed", "<dict>", Runtime.plain(plugin_path), json.dumps(source))
    if isinstance(source, os.PathLike) or (
            isinstance(source, str) and "\n" not in source and "=" not in source
            and not _looks_like_json(source)):
        path = os.fspath(source)
        is_json = format == "deepspeed"
        if format is None:
            head = ""
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    head = f.read(4096).decode("utf-8", "replace")
            is_json = _looks_like_json(head, path)
        if is_json:
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise ConfigError(f"{path}: cannot read the DeepSpeed config: {e.strerror}") from e
            return Config("deepspeed", path, Runtime.plain(plugin_path), text,
                          os.path.dirname(os.path.abspath(path)))
        runtime = Runtime.from_file(path, plugin_path)
        return Config("toml", path, runtime, None, runtime.base_dir)
    if isinstance(source, str):
        if format == "deepspeed" or (format is None and _looks_like_json(source)):
            return Config("deepspeed", "<string>", Runtime.plain(plugin_path), source,
                          os.getcwd())
        return Config("toml", "<string>", Runtime.from_toml(source, "<string>", plugin_path))
    raise InvalidArgumentError(
        f"config: expected a path, a TOML/JSON string or a dict, got {type(source).__name__}")


def plugins(kind=None, *, plugin_path=None):
    """The installed plugins (as ``ductile plugins list``): dicts with kind,
    name, version, description, file and params."""
    return Runtime.plain(plugin_path).plugins(kind)
