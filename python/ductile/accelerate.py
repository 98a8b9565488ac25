"""ductile for a training loop on Hugging Face Accelerate: ductile's ZeRO-3
engine under Accelerate's DeepSpeed integration.

    from ductile.accelerate import Accelerator     # was: from accelerate import Accelerator
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config="ds.json"))
    model = AutoModelForCausalLM.from_config(config)          # partitioned by ductile
    model, optimizer, loader, lr_scheduler = accelerator.prepare(
        model, optimizer, loader, lr_scheduler)                # ductile's DeepSpeedEngine
    for batch in loader:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step(); lr_scheduler.step(); optimizer.zero_grad()
    accelerator.save_state("ckpt")                             # or load_state("ckpt")
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(out, is_main_process=accelerator.is_main_process,
                              save_function=accelerator.save,
                              state_dict=accelerator.get_state_dict(model))

When the accelerator's distributed type is DeepSpeed (a ``DeepSpeedPlugin``,
``accelerate launch`` with a DeepSpeed config), Accelerate does everything
it always does (fills the config's "auto" values, builds the optimizer and
scheduler the config names for ``DummyOptim``/``DummyScheduler``, wraps
them, steps the engine from ``backward`` at accumulation boundaries, saves
and loads checkpoints through the engine, gathers the model for
``get_state_dict``), but the engine ``prepare`` makes is ductile's
(``ductile.deepspeed.initialize``). Importing this module also makes
transformers' ZeRO-3 model creation ductile's (``from_config`` and
``from_pretrained`` under a ZeRO-3 config partition the model with ductile's
``zero.Init``), so the model reaches ``prepare`` already partitioned by
ductile. Without DeepSpeed, ``Accelerator`` is Accelerate's, unchanged.
docs/deepspeed.md, "Accelerate".
"""

import warnings
from typing import Any

import accelerate
import torch
from accelerate.utils import DistributedType

from ._hf_zero3 import ductile_engine, use_ductile_zero3
from .deepspeed import DeepSpeedEngine

__all__ = ["Accelerator"]

_UNTESTED_OPTIMIZER = "zero_allow_untested_optimizer"

# A script imports this module before it makes its model: from here on,
# transformers' ZeRO-3 builds and loads models into ductile's partitions.
use_ductile_zero3()


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` whose DeepSpeed engine is ductile's.
    Takes Accelerate's arguments as they are; only two methods differ, and
    only under DeepSpeed:

    - ``prepare``: ``deepspeed.initialize``, which Accelerate calls to make
      the engine, is ``ductile.deepspeed.initialize`` while it runs (and
      the config key ``zero_allow_untested_optimizer``, which Accelerate
      adds for a torch optimizer, is not warned about unless the script's
      config has it);
    - ``unwrap_model``: takes ductile's ``DeepSpeedEngine`` off as
      Accelerate takes DeepSpeed's off (it knows DeepSpeed's class only),
      giving the user's model.
    """

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        deepspeed = self.distributed_type == DistributedType.DEEPSPEED
        if deepspeed and not hasattr(self, "_ductile_config_keys"):
            # The config's keys as the script gave them, before Accelerate
            # adds its own to them.
            self._ductile_config_keys = set(self.state.deepspeed_plugin.deepspeed_config)
        with ductile_engine(deepspeed), warnings.catch_warnings():
            if deepspeed and _UNTESTED_OPTIMIZER not in self._ductile_config_keys:
                # Accelerate sets this key itself for a torch optimizer;
                # ductile's warning that it has no effect would name a key
                # the script never wrote.
                warnings.filterwarnings("ignore", message=f".*{_UNTESTED_OPTIMIZER} is accepted")
            return super().prepare(*args, device_placement=device_placement)

    def unwrap_model(self, model: torch.nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> torch.nn.Module:
        while isinstance(model, DeepSpeedEngine):
            model = model.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper,
                                    keep_torch_compile=keep_torch_compile)
