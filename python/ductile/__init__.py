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


def __getattr__(name):
    try:
        module_name, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'ductile' has no attribute '{name}'") from None
    module = importlib.import_module(module_name, __name__)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
