"""FSDP2: every process holds a slice of every parameter, gradient and optimizer state (``hardware=fsdp``).

PyTorch's ``fully_shard`` is called here directly, once per decoder layer and then on the whole model, because
Accelerate's FSDP plugin silently trains plain DDP on CPU processes (measured: ``scale_findings.md``). This
runs for real on CPU processes (gloo) as on GPUs (NCCL): the same code, tested on CPU.

What differs from :class:`~rlhf.hardware.base.DataParallel`:

- ``prepare`` shards the model in place (its parameters become ``Shard(0)`` DTensors), then builds the optimizer
  on the sharded parameters; Accelerate prepares only the optimizer and the training loader.
- ``accumulate(sync=False)`` keeps the micro-batch's gradients unsharded and unreduced until the last one.
- ``clip_gradients`` clips with the norm of the whole (sharded) gradient, computed across processes.
- ``full_state_dict`` gathers the whole model onto the main process's CPU (a collective: every process calls it).
- ``save_state``/``load_state`` write and read each rank's shards of the model and optimizer with
  ``torch.distributed.checkpoint`` (exact resume; the same number of processes).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from rlhf.core.errors import UserError
from rlhf.core.file_io import load_torch
from rlhf.hardware.sharded import Sharded
from rlhf.models.quantize import has_8bit_weights

log = logging.getLogger(__name__)


def layers_to_shard(model: torch.nn.Module, class_names: list[str] | None) -> list[torch.nn.Module]:
    """The modules sharded (and gathered) one at a time: instances of `class_names`, or when that is None, of
    the classes the Hugging Face model names in ``_no_split_modules`` (its decoder layers)."""
    if class_names is None:
        class_names = []
        for module in model.modules():  # a PEFT wrapper holds the transformers model further down
            class_names += list(getattr(module, "_no_split_modules", None) or [])
    wanted = set(class_names)
    return [m for m in model.modules() if type(m).__name__ in wanted]


class FSDP2(Sharded):
    """Fully sharded data parallel (PyTorch FSDP2): parameters, gradients and optimizer states split over the
    processes; each layer's whole parameters are gathered just for its forward and backward.

    Args (besides :class:`~rlhf.hardware.base.DataParallel`'s; ``num_processes: null`` is 2 without GPU):
        reshard_after_forward: free each layer's gathered parameters after its forward and gather them again
            for the backward (least memory, ZeRO-3-like); ``false`` keeps them until the backward (one
            all-gather fewer per layer and step, ZeRO-2-like memory).
        layer_classes: class names of the modules sharded as units (e.g. ``[LlamaDecoderLayer]``); ``null``: the
            model's own ``_no_split_modules`` (its decoder layers for Hugging Face models).
        mixed_precision: ``no``, or ``bf16``: FSDP2 computes and gathers parameters in bf16 and reduces gradients
            in fp32, keeping (and saving) fp32 parameters and optimizer states (``MixedPrecisionPolicy``); the
            logits come out in fp32 for the losses. Runs on CPU processes too (tested). ``fp16`` is refused, as by
            every strategy.

    With one process (``hardware.num_processes=1``) the model is sharded over a process group of one: the
    computation of ``hardware=gpu``/``cpu`` (the same losses, tested), through the sharded path's own code (its
    gathering, its state dicts), e.g. to run that path on a single GPU.
    """

    def __init__(
        self,
        device: str = "auto",
        num_processes: int | None = None,
        num_nodes: int = 1,
        mixed_precision: str = "no",
        threads_per_process: int | None = None,
        rdzv_endpoint: str | None = None,
        node_rank: int = 0,
        timeout_s: int = 600,
        compile: bool | str = False,
        reshard_after_forward: bool = True,
        layer_classes: list[str] | None = None,
    ) -> None:
        super().__init__(device=device, num_processes=num_processes, num_nodes=num_nodes,
                         mixed_precision=mixed_precision, threads_per_process=threads_per_process,
                         rdzv_endpoint=rdzv_endpoint, node_rank=node_rank, timeout_s=timeout_s,
                         compile=compile)
        self.reshard_after_forward = reshard_after_forward
        self.layer_classes = list(layer_classes) if layer_classes is not None else None

    # --- training -------------------------------------------------------------------------------------------
    def sharded_state(self) -> frozenset[str]:
        return frozenset({"weights", "gradients", "optimizer"})

    def prepare(self, model, make_optimizer, train_loader):
        """Shard each layer, then the whole model; build the optimizer on the sharded parameters."""
        critic = getattr(model, "value_head", None)
        if getattr(critic, "backbone", None) is not None:  # rlhf.models.value_head: PPO's separate critic
            raise UserError("algo.separate_critic=true under hardware=fsdp is not supported yet (FSDP2 crashed on the "
                            "critic's copy of the backbone in its tests). Fix: algo.separate_critic=false (the value head "
                            "on the policy's trunk, which FSDP2 runs), or hardware=zero3 / cpu_ddp / ddp")
        acc = self.accelerator
        layers = self._shard(model, self.reshard_after_forward)
        optimizer = make_optimizer(model)  # after sharding: it must hold the sharded parameters
        optimizer, train_loader = acc.prepare(optimizer, train_loader)
        self._sharding = (f"; FSDP2 over {len(layers)} layer(s) + root, reshard_after_forward="
                          f"{self.reshard_after_forward}: {self.holding(model.parameters(), 'parameter')}, "
                          "optimizer states likewise")
        return model, optimizer, train_loader

    def _shard(self, model: torch.nn.Module, reshard_after_forward: bool) -> list[torch.nn.Module]:
        """``fully_shard`` each layer (:func:`layers_to_shard`), then the whole model, in place; return the
        layers."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        acc = self.accelerator
        if not torch.distributed.is_initialized():
            if acc.num_processes > 1:
                raise UserError("hardware=fsdp with several processes needs them started together (this package's "
                                "launcher or torchrun). Fix: python train.py hardware=fsdp hardware.num_processes=2")
            # one process (a single GPU, to run the sharded path itself): a process group of one, as ZeRO makes
            import datetime

            from rlhf.hardware.ports import free_port

            torch.distributed.init_process_group(
                "nccl" if acc.device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                rank=0, world_size=1, timeout=datetime.timedelta(seconds=self.timeout_s))
        mesh = init_device_mesh(acc.device.type, (acc.num_processes,))
        options = {"mesh": mesh, "reshard_after_forward": reshard_after_forward, "mp_policy": self._policy()}
        layers = layers_to_shard(model, self.layer_classes)
        if not layers:
            log.warning("hardware=fsdp found no layer to shard on its own (layer_classes=%s, model has no "
                        "_no_split_modules): the whole model is one unit, gathered whole for every forward. "
                        "Fix: hardware.layer_classes=[<decoder layer class name>]", self.layer_classes)
        for layer in layers:  # each moved to the device as it is sharded: never the whole model there at once
            fully_shard(layer, **options)
        # The rest (embeddings, final norm, head). Its outputs (the logits) in fp32, as autocast gives the losses'
        # log-softmax: computed in bf16, a sum of log-probabilities would lose most of its digits.
        fully_shard(model, **{**options, "mp_policy": self._policy(output_dtype=torch.float32)})
        return layers

    def _place_frozen(self, module: torch.nn.Module) -> torch.nn.Module:
        """Shard a frozen model like the policy (each layer, then the whole), in the policy's mixed precision. It
        never runs a backward, so every unit, the root included, frees its gathered parameters right after its
        forward (``reshard_after_forward=True`` whatever the policy's setting: FSDP2 leaves the root gathered after
        the forward only when this is left unset). A model with 8-bit weights (``algo/reference=int8``) stays whole
        on every process, as :class:`~rlhf.hardware.base.DataParallel` keeps it: FSDP2 loses the scales that
        bitsandbytes keeps beside each 8-bit matrix (measured: the forward fails), and 8 bits whole are already a
        quarter of a float32 copy."""
        if has_8bit_weights(module):
            log.info("hardware=fsdp keeps the 8-bit reference whole on every process (FSDP2 cannot shard "
                     "bitsandbytes' 8-bit weights)")
            return super(Sharded, self)._place_frozen(module)
        self._shard(module, reshard_after_forward=True)
        return module

    def frozen_share(self, quantized: bool = False) -> float:
        """Each process holds 1/processes of a frozen model (:meth:`_place_frozen`); one with 8-bit weights whole."""
        return 1.0 if quantized else 1.0 / self.processes()

    def _policy(self, output_dtype: torch.dtype | None = None):
        """FSDP2's mixed precision: for bf16, parameters gathered and used in bf16, gradients reduced in fp32
        (the sharded parameters and the optimizer stay fp32)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.mixed_precision != "bf16":
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=output_dtype)

    @contextlib.contextmanager
    def accumulate(self, model, sync: bool) -> Iterator[None]:
        """Reduce-scatter the gradients only on the last micro-batch (the others accumulate unsharded ones)."""
        model.set_requires_gradient_sync(sync)
        yield

    def backward(self, loss: torch.Tensor, model) -> None:
        loss.backward()

    def clip_gradients(self, model, max_grad_norm: float | None) -> torch.Tensor | None:
        """The norm of the whole (sharded) gradient, computed across processes; clip to ``max_grad_norm``."""
        limit = float("inf") if max_grad_norm is None else max_grad_norm
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), limit)  # DTensor-aware
        return total.full_tensor() if hasattr(total, "full_tensor") else total

    # --- saving -------------------------------------------------------------------------------------------
    def unwrap(self, model) -> torch.nn.Module:
        return model  # sharded in place: still the Hugging Face model (save_pretrained needs a state dict)

    def full_state_dict(self, model) -> dict[str, torch.Tensor] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.accelerator.is_main_process else None

    def save_state(self, model, optimizer, folder) -> None:
        """Each rank's shards of the model and the optimizer, with ``torch.distributed.checkpoint``. It gathers
        the ranks' write failures and raises them on every rank, as ``CheckpointException`` (a BaseException):
        raised here as OSError, naming each failed rank's error."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(model, _inner(optimizer))
        try:
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder / "sharded"))
        except CheckpointException as failed:  # a BaseException, raised on every rank with every rank's failure
            errors = {rank: error for rank, (error, _) in failed.failures.items()}
            if not all(isinstance(e, (OSError, RuntimeError)) for e in errors.values()):  # not a write: a bug
                raise RuntimeError(f"torch.distributed.checkpoint failed: {failed}") from None
            raise OSError("; ".join(f"rank {rank}: {error}" for rank, error in sorted(errors.items()))) from None

    def load_state(self, model, optimizer, folder) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(model, _inner(optimizer))
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(folder / "sharded"), planner=_weights_only_planner(self.accelerator.device))
        set_state_dict(model, _inner(optimizer), model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])

    def local_parameters(self, model) -> list[torch.Tensor]:
        return [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]


def _weights_only_planner(device: torch.device):
    """``torch.distributed.checkpoint``'s default load planner, except that the entries that are not tensors (the
    optimizer's hyperparameters and step counts, saved as pickled bytes) are read with
    ``torch.load(weights_only=True)`` (torch's own reads them with ``weights_only=False``), any tensor in them onto
    ``device``, this process's (:func:`rlhf.core.file_io.load_torch`; the tensor entries are read onto the CPU, then copied
    into the live state)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value) -> None:
            loaded = load_torch(value, device)
            if self.flatten_state_dict:  # the default: put it back into the nested state dict
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return WeightsOnlyLoadPlanner()


def _inner(optimizer):
    """The torch optimizer inside Accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)
