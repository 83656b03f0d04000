"""DeepSpeed ZeRO stages 1, 2 and 3 (``hardware=zero1``, ``zero2``, ``zero3``), called directly.

Accelerate's DeepSpeed plugin silently trains plain DDP on CPU processes (measured: ``scale_findings.md``), so
this strategy calls ``deepspeed.initialize`` itself; it then runs for real on CPU processes (gloo) as on GPUs
(NCCL). What each stage partitions over the processes:

- stage 1: the optimizer states (and the fp32 master weights they update);
- stage 2: also the gradients (reduce-scattered during the backward, micro-batch by micro-batch);
- stage 3: also the parameters (each layer's are gathered just for its forward and backward).

How it fits the loop, which owns gradient accumulation (it divides the loss by the number of micro-batches and
says which micro-batch ends a step): DeepSpeed is configured with ``gradient_accumulation_steps: 1``, so it
never divides the loss again, and ``accumulate(sync)`` tells the engine whether this micro-batch is the
accumulation boundary (``set_gradient_accumulation_boundary``). ``step`` calls ``engine.step()``,
which reduces what is left, clips, steps and zeroes the gradients.

DeepSpeed is an optional extra: ``pip install 'rlhf[deepspeed]'`` (tested with 0.19.8). Stage 3 replaces
``torch.nn.functional.linear`` for the rest of the process (DeepSpeed's "memory-efficient linear": the same
values to ~1e-7).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import importlib.util
import logging
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlhf.core.errors import UserError
from rlhf.core.limits import limits
from rlhf.hardware.holding import StoredPrecision, global_numel
from rlhf.hardware.ports import free_port
from rlhf.hardware.precision import FP16_REASON
from rlhf.hardware.sharded import Sharded, name_deepspeed_accelerator
from rlhf.models.quantize import is_quantized

log = logging.getLogger(__name__)

STAGES = (1, 2, 3)
INSTALL = "pip install 'rlhf[deepspeed]'  (or: pip install 'deepspeed>=0.16')"


def import_deepspeed(cuda: bool):
    """Import DeepSpeed for this device, quietly, without its 30-70 s compilation of a CPU communication op."""
    name_deepspeed_accelerator(cuda)
    try:
        import deepspeed
    except ImportError as error:
        raise UserError(f"hardware=zero* needs DeepSpeed, an optional extra ({error}). Fix: {INSTALL}") from None
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed calls torch.distributed functions that torch 2.13 deprecates: once per process and call site.
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    # deepspeed_shm_comm serves only DeepSpeed's inference all-reduce on CPU; building it is a 30-70 s JIT
    # compilation at the first init_distributed (needs g++ and ninja). Training results are unchanged without it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


def _merge(base: dict, extra: dict) -> dict:
    """`base` with `extra` merged in, nested dictionaries key by key."""
    merged = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _stepped(engine, optimizer) -> int:
    """Elements this process's optimizer updates and keeps states for: its fp32 partition of the trainable ones."""
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat_partition"):
        flat = getattr(engine.optimizer, name, None)  # stages 1-2, stage 3, bf16 optimizer
        if flat:
            return sum(t.numel() for t in flat)
    return sum(p.numel() for group in optimizer.param_groups for p in group["params"])


def _no_fp16_in_deepspeed_config(values: Mapping[str, Any], where: str) -> None:
    """fp16 through ``deepspeed_config`` is fp16 all the same: refused with the same message."""
    extra = values.get("deepspeed_config") or {}
    fp16 = extra.get("fp16") if isinstance(extra, Mapping) else None
    if isinstance(fp16, Mapping) and fp16.get("enabled"):
        raise UserError(f"{where}.deepspeed_config.fp16.enabled=true is not supported: {FP16_REASON}. Fix: leave fp16 "
                        f"out of {where}.deepspeed_config and set {where}.mixed_precision=bf16.")


@limits(_no_fp16_in_deepspeed_config)
class ZeRO(Sharded):
    """DeepSpeed ZeRO data parallelism: optimizer states (stage 1), gradients (2) and parameters (3) split over
    the processes.

    Args (besides :class:`~rlhf.hardware.base.DataParallel`'s; ``num_processes: null`` is 2 without GPU):
        stage: 1, 2 or 3 (see the module's docstring).
        max_grad_norm: clip the global gradient norm to this (``null``: no clipping). DeepSpeed must know it when
            the engine is built (and clips at 1.0 when told nothing), so the YAML sets it to
            ``${train.max_grad_norm}``; ``clip_gradients`` refuses a different value from the loop.
        param_persistence_threshold: stage 3 keeps parameters with fewer elements than this gathered on every
            process (DeepSpeed's ``stage3_param_persistence_threshold``; its default 1e5 keeps all of a tiny
            model whole: 0 partitions everything).
        mixed_precision: ``no`` or ``bf16``: DeepSpeed's own mixed precision, which keeps the model in bf16 and
            fp32 master weights in the optimizer; the saved model is in bf16, as Hugging Face's Trainer saves it.
            bf16 runs on CPU processes (tested). ``fp16`` is refused, as by every strategy, here too when asked
            through ``deepspeed_config`` (``fp16: {enabled: true}``).
        deepspeed_config: further DeepSpeed config entries, merged over the ones built here (e.g.
            ``{zero_optimization: {offload_optimizer: {device: cpu}}}``); see DeepSpeed's config reference.
    """

    def __init__(
        self,
        stage: int = 3,
        max_grad_norm: float | None = 1.0,
        param_persistence_threshold: int = 100_000,
        deepspeed_config: dict | None = None,
        device: str = "auto",
        num_processes: int | None = None,
        num_nodes: int = 1,
        mixed_precision: str = "no",
        threads_per_process: int | None = None,
        rdzv_endpoint: str | None = None,
        node_rank: int = 0,
        timeout_s: int = 600,
        compile: bool | str = False,
    ) -> None:
        super().__init__(device=device, num_processes=num_processes, num_nodes=num_nodes,
                         mixed_precision=mixed_precision, threads_per_process=threads_per_process,
                         rdzv_endpoint=rdzv_endpoint, node_rank=node_rank, timeout_s=timeout_s,
                         compile=compile)
        if stage not in STAGES:
            raise UserError(f"hardware.stage={stage} is not a ZeRO stage. Fix: 1, 2 or 3 (hardware=zero1/2/3).")
        if max_grad_norm is not None and max_grad_norm <= 0:
            raise UserError(f"hardware.max_grad_norm={max_grad_norm} must be > 0, or null for no clipping.")
        if param_persistence_threshold < 0:
            raise UserError(f"hardware.param_persistence_threshold={param_persistence_threshold} must be >= 0.")
        if importlib.util.find_spec("deepspeed") is None:  # checked here: before any process is started
            raise UserError(f"hardware=zero{stage} needs DeepSpeed, an optional extra that is not installed. "
                            f"Fix: {INSTALL}")
        self.stage, self.max_grad_norm = stage, max_grad_norm
        self.param_persistence_threshold = param_persistence_threshold
        if isinstance(deepspeed_config, DictConfig):  # as Hydra passes it
            deepspeed_config = OmegaConf.to_container(deepspeed_config, resolve=True)
        self.deepspeed_config = dict(deepspeed_config or {})
        _no_fp16_in_deepspeed_config({"deepspeed_config": self.deepspeed_config}, "hardware")

    # --- processes ---------------------------------------------------------------------------------------
    def start(self, *args, **kwargs):
        deepspeed = import_deepspeed(self.uses_cuda())
        accelerator = super().start(*args, **kwargs)
        if not torch.distributed.is_initialized():  # one process (e.g. ZeRO-Offload on one GPU): no group yet

            os.environ.setdefault("LOCAL_RANK", "0")  # DeepSpeed reads it (launchers set it)
            torch.distributed.init_process_group(
                "nccl" if self.uses_cuda() else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                world_size=1, timeout=datetime.timedelta(seconds=self.timeout_s))
        # Adopts the process group made above or by Accelerate (same backend: nccl on GPUs, gloo on CPUs).
        deepspeed.init_distributed(dist_backend="nccl" if self.uses_cuda() else "gloo",
                                   timeout=datetime.timedelta(seconds=self.timeout_s), verbose=False)
        return accelerator

    def sharded_state(self) -> frozenset[str]:
        """ZeRO-1 splits the optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the weights."""
        return frozenset(["optimizer", "gradients", "weights"][: self.stage])

    def deepspeed_settings(self, micro_batch_size: int) -> dict[str, Any]:
        """The DeepSpeed config this strategy gives ``deepspeed.initialize``."""
        zero: dict[str, Any] = {"stage": self.stage}
        if self.stage == 3:
            zero["stage3_param_persistence_threshold"] = self.param_persistence_threshold
        settings = {
            "train_micro_batch_size_per_gpu": micro_batch_size,
            "gradient_accumulation_steps": 1,  # the loop accumulates: it divides the loss itself (module docstring)
            "gradient_clipping": 0.0 if self.max_grad_norm is None else float(self.max_grad_norm),  # default: 1.0!
            "zero_allow_untested_optimizer": True,  # optimizers come from conf/optimizer, not DeepSpeed's list
            "zero_optimization": zero,
            "bf16": {"enabled": self.mixed_precision == "bf16"},
            "steps_per_print": 1 << 62,  # the loop logs; DeepSpeed's own progress lines never print
            "wall_clock_breakdown": False,
        }
        return _merge(settings, self.deepspeed_config)

    # --- training -------------------------------------------------------------------------------------------
    def prepare(self, model, make_optimizer, train_loader):
        """Build the optimizer, hand model and optimizer to ``deepspeed.initialize`` (which partitions them);
        Accelerate shards the training loader. Returns the engine as the model and the optimizer given to it
        (its parameter groups, which the scheduler changes, are the ones DeepSpeed's optimizer steps)."""
        import deepspeed

        acc = self.accelerator
        optimizer = make_optimizer(model)  # DeepSpeed moves the model to the device and partitions it
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.deepspeed_settings(train_loader.batch_size))
        self._use_own_checkpoint_engine(engine)
        train_loader = acc.prepare(train_loader)
        trainable = sum(global_numel(p) for p in engine.module.parameters() if p.requires_grad)
        whole = sum(1 for p in engine.module.parameters() if getattr(p, "ds_persist", False))
        kept = f", {whole} parameter(s) also kept whole (under param_persistence_threshold)" if whole else ""
        self._sharding = (f"; ZeRO-{self.stage}: {self.holding(engine.module.parameters(), 'parameter')}{kept}; "
                          f"its optimizer steps {_stepped(engine, optimizer):,} of {trainable:,} trainable elements")
        return engine, optimizer, train_loader

    def _place_frozen(self, module: torch.nn.Module) -> torch.nn.Module:
        """Stage 3: partition a frozen model like the policy, in a DeepSpeed engine of its own without optimizer
        (the way TRL prepares its reference under ZeRO-3), built from this strategy's settings (precision,
        ``param_persistence_threshold``, ``deepspeed_config``); each layer's parameters are gathered just for its
        forward. Stages 1 and 2 partition no parameters: a whole copy on the device, as
        :class:`~rlhf.hardware.base.DataParallel` keeps it."""
        if self.stage != 3:
            return super()._place_frozen(module)
        deepspeed = import_deepspeed(self.uses_cuda())
        # The batch size is required by DeepSpeed's config checks and used only for training: a forward-only engine.
        engine, _, _, _ = deepspeed.initialize(model=module, config=self.deepspeed_settings(micro_batch_size=1))
        engine.eval()  # DeepSpeed's engine returns None here, not itself
        return engine

    def frozen_share(self, quantized: bool = False) -> float:
        """Stage 3: 1/processes of a frozen model (a little more in fact: parameters under
        ``param_persistence_threshold`` stay whole on every process; the measured share is in :attr:`frozen_held`);
        stages 1 and 2: a whole copy."""
        return 1.0 / self.processes() if self.stage == 3 else 1.0

    def stored_precision(self) -> StoredPrecision:
        """With ``mixed_precision=bf16`` DeepSpeed keeps the model in bf16 and a float32 master copy of the weights
        in its optimizer, whose states are then float32 (both split like the optimizer state)."""
        if self.mixed_precision == "bf16":
            return StoredPrecision(weight_bytes=2, master_bytes=4, optimizer_dtype=torch.float32)
        return StoredPrecision()

    @contextlib.contextmanager
    def accumulate(self, model, sync: bool) -> Iterator[None]:
        """Tell the engine whether this micro-batch ends the step. Stage 1 then reduces the gradients only at the
        end; stages 2 and 3 reduce-scatter every micro-batch's into their partitions (that is how they save
        memory), so sync=False saves no communication there."""
        model.set_gradient_accumulation_boundary(sync)
        yield

    def backward(self, loss: torch.Tensor, model) -> None:
        model.backward(loss, scale_wrt_gas=False)  # the loop already divided the loss by its accumulation

    def clip_gradients(self, model, max_grad_norm: float | None) -> float | None:
        """Nothing yet: ``engine.step()`` clips (to the max_grad_norm DeepSpeed was built with) and only then
        knows the norm."""
        if max_grad_norm != self.max_grad_norm:
            raise UserError(f"train.max_grad_norm={max_grad_norm} but hardware.max_grad_norm={self.max_grad_norm}: "
                            "DeepSpeed clips with the latter. Fix: leave hardware.max_grad_norm at its default "
                            "${train.max_grad_norm}.")
        return None

    def step(self, model, optimizer) -> float | None:
        """``engine.step()``: clip, step, zero the gradients; return the global norm before clipping."""
        model.step()
        norm = model.get_global_grad_norm()
        return None if norm is None else float(norm)

    def skip_step(self, model, optimizer) -> None:
        """Drop the step's gradients: DeepSpeed's optimizer wrapper zeroes its partitions of them."""
        model.zero_grad()
        if hasattr(model.optimizer, "zero_grad"):
            model.optimizer.zero_grad(set_to_none=True)

    # --- saving -------------------------------------------------------------------------------------------
    def unwrap(self, model) -> torch.nn.Module:
        return model.module if hasattr(model, "module") else model

    def full_state_dict(self, model) -> dict[str, torch.Tensor] | None:
        """Stage 3 gathers the partitioned parameters onto the main process (every process calls this; in the
        model's dtype despite DeepSpeed's name '16bit'); stages 1 and 2 hold whole replicas."""
        if self.stage == 3:
            state = model._zero3_consolidated_16bit_state_dict()
            return state if self.accelerator.is_main_process else None
        return None

    @staticmethod
    def _use_own_checkpoint_engine(engine) -> None:
        """DeepSpeed's files are written and read by :class:`~rlhf.hardware.zero_files.WeightsOnlyEngine`
        (weights-only loads; a failed write raised after the save's closing barrier)."""
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        from rlhf.hardware.zero_files import install

        if type(engine.checkpoint_engine) is not TorchCheckpointEngine:
            raise UserError(f"hardware.deepspeed_config selects DeepSpeed's {type(engine.checkpoint_engine).__name__} "
                            "for checkpoints; rlhf writes and reads ZeRO checkpoints with its own engine (weights-only "
                            "loads, failed writes reported on every rank). Fix: leave the checkpoint writer and "
                            "datastates settings out of hardware.deepspeed_config.")
        install(engine)

    def save_state(self, model, optimizer, folder) -> None:
        """Each rank's partitions of the model and optimizer, with DeepSpeed's ``save_checkpoint``. A rank whose
        write failed raises it (OSError) only once every rank has passed the save's closing barrier."""
        model.save_checkpoint(str(folder / "zero"), tag="state", save_latest=False)
        model.checkpoint_engine.raise_failure()

    def load_state(self, model, optimizer, folder) -> None:
        """Each rank's partitions back. A base loaded in 4 or 8 bits (peft=qlora) saved bitsandbytes' quantization
        constants beside its weights, which the freshly built model holds as attributes, not entries: DeepSpeed then
        loads the module non-strictly (the frozen base is the one the config builds again, as on every resume)."""
        path, _ = model.load_checkpoint(str(folder / "zero"), tag="state", load_optimizer_states=True,
                                        load_lr_scheduler_states=False,
                                        load_module_strict=not is_quantized(self.unwrap(model)))
        if path is None:
            raise UserError(f"{folder}: DeepSpeed found no ZeRO state in it. Fix: resume from a checkpoint written "
                            "with the same hardware option.")

    def local_parameters(self, model) -> list[torch.Tensor]:
        return [p.ds_tensor if hasattr(p, "ds_tensor") else p for p in self.unwrap(model).parameters()]
