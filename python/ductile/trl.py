"""ductile for TRL's trainers: ``SFTTrainer``, ``DPOTrainer`` and
``RewardTrainer`` on ductile's ZeRO-3 engine, with the import line changed:

    from ductile.trl import SFTTrainer               # was: from trl import SFTTrainer
    trainer = SFTTrainer(model="path/to/model",
                         args=SFTConfig(..., deepspeed="ds.json"),
                         train_dataset=dataset)
    trainer.train()

With ``args.deepspeed`` (a DeepSpeed config with ZeRO stage 3) each trainer
runs TRL's code as it is, on the HF Trainer's DeepSpeed integration, but
every engine it makes is ductile's: the policy's (``train``, ``evaluate``,
``predict``, as ``ductile.hf.DuctileTrainer``'s) and a DPO reference
model's (which TRL prepares with ``deepspeed.initialize`` as the trainer is
made). Importing this module also makes transformers' ZeRO-3 model creation
ductile's, so a model given as a path string, and DPO's reference model
loaded from it, are partitioned by ductile from their first parameter.
docs/deepspeed.md, "TRL".
"""

import contextlib
import importlib.util
from typing import Any

import trl
import trl.trainer.utils

from ._errors import IncompatibleError
from ._hf_in_place import InPlaceTrainer
from .torch.zero3._snapshots import not_the_training
from ._hf_zero3 import ductile_engine, use_ductile_zero3, warn_if_untested

__all__ = ["SFTTrainer", "DPOTrainer", "RewardTrainer"]

# The TRL releases whose trainers these are tested with. Only public
# methods are overridden; a TRL whose trainers make their engines elsewhere
# would escape the swap, hence the warning.
TESTED_TRL = "1.16"

# A script imports this module before it makes its model: from here on,
# transformers' ZeRO-3 builds and loads models into ductile's partitions.
use_ductile_zero3()
warn_if_untested("trl", TESTED_TRL, "ductile.trl")

_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


def _lm_head_in_pass(*params: Any) -> Any:
    """TRL's fused LM head reads ``lm_head.weight`` inside the model's own
    forward without calling the head module, and under ZeRO-3 gathers it
    with DeepSpeed's ``GatheredParameters``. ductile's engine has it
    already: a causal LM's head (tied to the embeddings, or the root's own)
    is gathered for the whole forward of the model it belongs to, and for
    its backward. DeepSpeed's parameters go to TRL's own gather."""
    present = [p for p in params if p is not None]
    if any(hasattr(p, "ds_status") for p in present):
        return _trl_gather(*params)
    if any(p.numel() == 0 for p in present):
        raise IncompatibleError(
            "ductile.trl: TRL's fused LM head reads the LM head's weight outside the forward "
            "of the module that holds it, where ductile's ZeRO-3 engine has not gathered it; "
            "valid: a model whose LM head belongs to its root module or is tied to its input "
            "embeddings")
    return contextlib.nullcontext()


_trl_gather = trl.trainer.utils.maybe_gather_lm_head_ctx
trl.trainer.utils.maybe_gather_lm_head_ctx = _lm_head_in_pass


class _OnDuctileEngine:
    """Makes every ``deepspeed.initialize`` of a TRL trainer ductile's: while
    it is made (a DPO reference model is prepared then), trains, evaluates
    and predicts. Without DeepSpeed installed nothing is swapped (the
    Trainer's DeepSpeed integration cannot run then either)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # An engine made here is a reference model's (DPO): the policy's is
        # made by train(), and it alone is the training's under the agent.
        with ductile_engine(_DEEPSPEED), not_the_training():
            super().__init__(*args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        with ductile_engine(_DEEPSPEED):
            return super().train(*args, **kwargs)  # type: ignore[misc]

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        with ductile_engine(_DEEPSPEED):
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        with ductile_engine(_DEEPSPEED):
            return super().predict(*args, **kwargs)  # type: ignore[misc]


class SFTTrainer(_OnDuctileEngine, InPlaceTrainer, trl.SFTTrainer):
    """``trl.SFTTrainer`` on ductile's ZeRO-3 engine (its arguments as they are);
    under ``ductile agent`` it goes on in place as DuctileTrainer does."""


class DPOTrainer(_OnDuctileEngine, InPlaceTrainer, trl.DPOTrainer):
    """``trl.DPOTrainer`` on ductile's ZeRO-3 engine, the reference model's too
    (under ``ductile agent`` its workers are restarted at a lost node, and
    enter their loop at the restored step: the reference model's engine does
    not rejoin a round)."""

    _in_place_refused = "its reference model's engine does not rejoin a round"


class RewardTrainer(_OnDuctileEngine, InPlaceTrainer, trl.RewardTrainer):
    """``trl.RewardTrainer`` on ductile's ZeRO-3 engine (its arguments as they
    are); under ``ductile agent`` it goes on in place as DuctileTrainer does."""
