"""Adam and AdamW on the CPU through the ``cpu_adam`` plugin:
``from ductile.ops.adam import DeepSpeedCPUAdam`` in place of
``from deepspeed.ops.adam import DeepSpeedCPUAdam``."""

from .cpu_adam import DeepSpeedCPUAdam, DuctileCPUAdam

__all__ = ["DuctileCPUAdam", "DeepSpeedCPUAdam"]
