"""DeepSpeed's training API on ductile's ZeRO-3 engine: a DeepSpeed script
moves to ductile by changing its import line.

    import ductile.deepspeed as deepspeed        # was: import deepspeed
    engine, optimizer, _, lr_scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters())
    for batch in loader:
        loss = engine(batch)
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint("ckpt")

docs/deepspeed.md lists what is honoured, warned about or refused, key by
key, and where ductile's answers differ from DeepSpeed's.
"""

from .._hf_zero3 import use_ductile_zero3_with_transformers
from . import lr_schedules, zero
from ._engine import DeepSpeedEngine
from ._initialize import add_config_arguments, init_distributed, initialize

# A script importing this module in place of deepspeed may make transformers
# models under ZeRO-3 (HfDeepSpeedConfig): they are ductile's partitions.
use_ductile_zero3_with_transformers()

__all__ = ["initialize", "init_distributed", "add_config_arguments", "DeepSpeedEngine", "zero",
           "lr_schedules"]
