"""ductile for Python: elasticity, variable-batch packing and learning-rate
scaling from ductile's C++ core and plugins.

    import ductile
    from ductile.elasticity import compute_elastic_config   # DeepSpeed's API
    plan = ductile.batching.pack(lengths, max_tokens=4096)   # numpy in, numpy out
    import ductile.torch                                      # samplers, LR scheduler (needs torch)

``import ductile`` needs numpy only; ``ductile.torch`` needs PyTorch 2.13 or newer.
Every C++ error arrives as a subclass of :class:`ductile.Error` carrying the
message the ``ductile`` CLI prints for the same input.

The names below are re-exported on first use (PEP 562), so that importing
the package costs nothing until one is used: the ``ductile`` command of a
pip install imports ``ductile.__main__`` only to start the C++ CLI.
"""

import importlib
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    # What __getattr__ returns, for type checkers and IDEs (`X as X`: a
    # re-export). The extension's names (init_logging, __version__) have no
    # stubs: __getattr__'s Any. The extension comes first: the modules below
    # import it from this package, and mypy would otherwise look it up
    # through __getattr__ while this file is still being analysed.
    from . import _ductile  # noqa: F401 - for mypy, as said
    from . import batching as batching
    from . import elasticity as elasticity
    from . import metrics as metrics
    from ._config import Config as Config
    from ._config import Runtime as Runtime
    from ._config import load_config as load_config
    from ._config import plugins as plugins
    from ._errors import CommunicationError as CommunicationError
    from ._errors import ConfigError as ConfigError
    from ._errors import ElasticityConfigError as ElasticityConfigError
    from ._errors import ElasticityError as ElasticityError
    from ._errors import ElasticityIncompatibleWorldSize as ElasticityIncompatibleWorldSize
    from ._errors import Error as Error
    from ._errors import IncompatibleError as IncompatibleError
    from ._errors import InternalError as InternalError
    from ._errors import InvalidArgumentError as InvalidArgumentError
    from ._errors import IoError as IoError
    from ._errors import NotEnoughSamplesError as NotEnoughSamplesError
    from ._errors import NotFoundError as NotFoundError
    from ._errors import PluginError as PluginError
    from ._errors import UnsupportedError as UnsupportedError

# name -> (module, attribute); attribute None: the module itself.
_EXPORTS = {
    "Config": ("._config", "Config"),
    "Runtime": ("._config", "Runtime"),
    "load_config": ("._config", "load_config"),
    "plugins": ("._config", "plugins"),
    "elasticity": (".elasticity", None),
    "batching": (".batching", None),
    "metrics": (".metrics", None),
    "init_logging": ("._ductile", "init_logging"),
    "__version__": ("._ductile", "__version__"),
}
_EXPORTS.update({name: ("._errors", name) for name in (
    "Error", "InvalidArgumentError", "ConfigError", "NotFoundError", "PluginError", "IoError",
    "IncompatibleError", "CommunicationError", "UnsupportedError", "InternalError",
    "ElasticityError", "ElasticityConfigError", "ElasticityIncompatibleWorldSize",
    "NotEnoughSamplesError")})

__all__ = [name for name in _EXPORTS if name != "__version__"]


def __getattr__(name: str) -> Any:
    try:
        module_name, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'ductile' has no attribute '{name}'") from None
    module = importlib.import_module(module_name, __name__)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if os.environ.get("DUCTILE_ROUND_END"):
    # A worker of `ductile agent`: a collective that fails because a peer
    # is gone ends it with one line, not a traceback (_round_end.py).
    from . import _round_end

    _round_end.install()

if os.environ.get("DUCTILE_ROUND_NOTICE"):
    # Which connections the script's process group makes: a worker held in
    # one of its collectives after the agent's notice has them shut
    # (_round_sockets.py).
    from . import _round_sockets

    _round_sockets.note_baseline()
