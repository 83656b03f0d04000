"""How the ZeRO strategy writes and reads DeepSpeed's checkpoint files: its own DeepSpeed checkpoint engine.

DeepSpeed reads and writes every file of ``engine.save_checkpoint`` / ``engine.load_checkpoint`` through the
engine's ``checkpoint_engine`` (no config option selects one: :meth:`rlhf.hardware.zero.ZeRO.prepare` puts this
one in place after ``deepspeed.initialize``). Two changes from DeepSpeed's own torch engine:

- **Loads run no code.** DeepSpeed's engine calls ``torch.load(weights_only=False)``. This one loads with
  ``weights_only=True``; the only classes DeepSpeed puts in its files besides tensors and plain values
  (:data:`DEEPSPEED_CLASSES`: the stage enum, the loss scaler's state, the bf16 optimizer's fragment addresses)
  are allowed through ``torch.serialization.safe_globals``, which rebuilds them from their fields without calling
  any other code.
- **A failed write never strands the ranks in different barriers.** ``save_checkpoint`` ends with a barrier that
  every rank must reach; a write that raised on one rank (a full disk) would send that rank on to the loop's next
  collective while the others wait in the barrier. This engine records the first failure, skips the rank's
  remaining writes and returns; :meth:`WeightsOnlyEngine.raise_failure`, called after ``save_checkpoint`` (after
  that barrier), raises it as :class:`OSError`, which :func:`rlhf.run.checkpoint.save` sums over the ranks. The one
  file DeepSpeed writes around its engine, rank 0's copy of its recovery scripts (``zero_to_fp32.py``), goes
  through the same record (:func:`install`).
"""

from __future__ import annotations

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.fp16.loss_scaler import LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils.tensor_fragment import fragment_address

from rlhf.core.file_io import save_torch

DEEPSPEED_CLASSES = [ZeroStageEnum, LossScaler, fragment_address]  # seen in the files of stages 1-3, fp32 and bf16


class WeightsOnlyEngine(TorchCheckpointEngine):
    """DeepSpeed's torch checkpoint engine, loading with ``weights_only=True`` and holding a failed write until
    the end of the save (module docstring)."""

    def __init__(self, config_params=None) -> None:
        super().__init__(config_params)
        self.name = type(self).__name__
        self.failure: OSError | None = None

    def makedirs(self, path, exist_ok: bool = False) -> None:
        if self.failure is None:
            try:
                super().makedirs(path, exist_ok=exist_ok)
            except OSError as error:
                self.failure = error

    def save(self, state_dict, path: str) -> None:
        if self.failure is None:
            try:
                save_torch(state_dict, path, zipfile=self.zipfile_serialization)
            except OSError as error:
                self.failure = error

    def load(self, path: str, map_location=None):
        with torch.serialization.safe_globals(DEEPSPEED_CLASSES):
            return torch.load(path, map_location=map_location, weights_only=True)

    def raise_failure(self) -> None:
        """Raise the write failure of the save that just ended (and forget it), if there was one."""
        failure, self.failure = self.failure, None
        if failure is not None:
            raise failure


def install(engine) -> WeightsOnlyEngine:
    """Put a :class:`WeightsOnlyEngine` in place of the DeepSpeed engine's checkpoint engine, and route its copy of
    the recovery scripts (a plain ``shutil.copyfile`` on rank 0, between the writes and the closing barrier)
    through the same failure record."""
    own = WeightsOnlyEngine(engine._config)
    engine.checkpoint_engine = own
    copy_scripts = getattr(engine, "_copy_recovery_script", None)  # DeepSpeed 0.16-0.19
    if copy_scripts is not None:
        def copy_recovery_script(save_path) -> None:
            if own.failure is None:
                try:
                    copy_scripts(save_path)
                except OSError as error:
                    own.failure = error

        engine._copy_recovery_script = copy_recovery_script
    return own
