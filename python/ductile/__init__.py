"""ductile for Python: elasticity, variable-batch packing and learning-rate
scaling from ductile's C++ core and plugins.

    import ductile
    from ductile.elasticity import compute_elastic_config   # DeepSpeed's API
    plan = ductile.batching.pack(lengths, max_tokens=4096)   # numpy in, numpy out
    import ductile.torch                                      # samplers, LR scheduler (needs torch)

``import ductile`` needs numpy only; ``ductile.torch`` needs PyTorch 2.13 or newer.
Every C++ error arrives as a subclass of :class:`ductile.Error` carrying the
message the ``ductile`` CLI prints for the same input.
"""

from . import _ductile
from ._errors import (  # noqa: F401
    CommunicationError, ConfigError, ElasticityConfigError, ElasticityError,
    ElasticityIncompatibleWorldSize, Error, IncompatibleError, InternalError,
    InvalidArgumentError, IoError, NotEnoughSamplesError, NotFoundError, PluginError,
    UnsupportedError)
from ._config import Config, Runtime, load_config, plugins  # noqa: F401
from . import elasticity, batching, metrics  # noqa: F401,E402

__version__ = _ductile.__version__
init_logging = _ductile.init_logging

__all__ = [
    "Config", "Runtime", "load_config", "plugins", "elasticity", "batching", "metrics",
    "init_logging", "Error", "InvalidArgumentError", "ConfigError", "NotFoundError",
    "PluginError", "IoError", "IncompatibleError", "CommunicationError", "UnsupportedError",
    "InternalError", "ElasticityError", "ElasticityConfigError",
    "ElasticityIncompatibleWorldSize", "NotEnoughSamplesError",
]
