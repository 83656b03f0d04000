"""How a run uses its hardware: the one object that differs between one process, DDP, FSDP2 and ZeRO.

A ``conf/hardware/*.yaml`` option builds a :class:`DataParallel` (or a subclass) through ``_target_``. The loop
calls the same methods whatever the option: ``start`` (the Accelerator and the process group), ``prepare_frozen``
(models that do not train; ``frozen_share`` predicts the share of one a process holds), ``prepare`` (the policy, its optimizer and the training loader),
``accumulate``/``backward``, ``clip_gradients`` (the norm before clipping), ``step`` (step and zero the gradients)
or ``skip_step`` (a non-finite step), ``save_state``/``load_state`` (checkpoints) and ``save_model`` (one whole
Hugging Face model, written by the main process). :mod:`rlhf.launch.processes` reads ``processes_per_node`` and
``num_nodes`` to start the processes; nothing else in the package knows about hardware.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
from accelerate.state import AcceleratorState

from rlhf.core.errors import UserError
from rlhf.core.file_io import save_safetensors, save_torch
from rlhf.core.limits import limits
from rlhf.hardware import compiling, cpus
from rlhf.hardware.cpus import cpus_available
from rlhf.hardware.frozen import is_trainable_only, load_trainable, save_trainable
from rlhf.hardware.holding import (
    FrozenHolding,
    StoredPrecision,
    global_numel,
    linear_weights_to_bf16,
    local_numel,
    without_tied_copies,
)
from rlhf.hardware.precision import check_precision, resolve_precision
from rlhf.ops.collectives import any_process

log = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")

def _known_precision(values: Mapping[str, Any], where: str) -> None:
    check_precision(values.get("mixed_precision", "no"), f"{where}.mixed_precision")


# Accelerate's DistributedType names, in words, for the start-up line.
_IN_WORDS = {"MULTI_CPU": "DDP over CPUs", "MULTI_GPU": "DDP over GPUs", "FSDP": "fully sharded",
             "DEEPSPEED": "DeepSpeed", "NO": "not distributed"}


@limits(_known_precision)  # checked with the config, before any process starts; subclasses inherit it
class DataParallel:
    """One process, or several that each hold the whole model and average gradients (DDP via Accelerate).

    Args:
        device: ``cpu``, ``cuda``, or ``auto`` (CUDA when present, else the CPU).
        num_processes: processes per machine; ``null``: one per local GPU (at least one).
        num_nodes: machines taking part (``multinode``); each runs the same command.
        mixed_precision: ``no`` or ``bf16`` autocast (parameters stay in ``model.dtype``), or ``auto``: ``bf16`` on
            a GPU that has it (Ampere on) and on a CPU with bf16 matrix instructions (AVX-512 BF16, AMX), else ``no``
            (:func:`resolve_precision`; the log says what it meant and why, the checkpoint records it). ``fp16`` is refused
            (:func:`check_precision`).
        threads_per_process: torch threads of each process; ``null``: ``OMP_NUM_THREADS`` if set, else the
            CPUs the job has divided by the processes on this machine (never oversubscribed).
        rdzv_endpoint: ``host:port`` where the processes of all machines meet (``multinode``); ``null``: a
            free port on 127.0.0.1 (one machine).
        node_rank: this machine's rank among ``num_nodes`` (``multinode``; 0 is the main one).
        timeout_s: how long a process waits for the others in a collective before failing.
        compile: ``auto`` (what :data:`rlhf.core.auto_choices.CHOICES` says: off on a CPU, where compiling was
            measured slower to start than it saves, and on a GPU until a GPU check measures ``layers`` faster), ``layers`` (each decoder layer of the policy and its frozen models compiled in place: regional
            compilation, :mod:`rlhf.hardware.compiling`; the output layer stays eager), ``true`` (each model
            compiled whole with torch's default backend, inductor), a backend's name (whole, with that backend:
            ``aot_eager``, the graphs captured and differentiated ahead of time, run without generated code), or
            ``false``. In place (``nn.Module.compile``: the checkpoints' keys are unchanged); while compiling, training
            batches are padded to a multiple of 64 positions (few lengths, few recompiles), shapes dynamic after
            the first recompile. The first steps (and the first evaluation) wait for the compiler: tens of seconds
            on a CPU. One process or DDP; the sharding options refuse it (``auto`` is off there).
    """

    compiles = True  # whether this strategy can compile the models it places (hardware.compile)

    def __init__(
        self,
        device: str = "auto",
        num_processes: int | None = 1,
        num_nodes: int = 1,
        mixed_precision: str = "no",
        threads_per_process: int | None = None,
        rdzv_endpoint: str | None = None,
        node_rank: int = 0,
        timeout_s: int = 600,
        compile: bool | str = "auto",
    ) -> None:
        asked, compile = compile, compiling.resolve_compile(compile, self._cuda(device), self.compiles)
        if compile and not self.compiles:
            raise UserError(f"hardware.compile={str(asked).lower()} is not built for {type(self).__name__} (a sharding option). "
                            "Fix: hardware.compile=false, or hardware=cpu / cpu_ddp / gpu / ddp")
        if device not in DEVICES:
            raise UserError(f"hardware.device={device!r} is not one of {list(DEVICES)}. Fix: e.g. hardware.device=cpu")
        check_precision(mixed_precision)
        for name, value, low in (("num_processes", num_processes, 1), ("num_nodes", num_nodes, 1),
                                 ("threads_per_process", threads_per_process, 1), ("timeout_s", timeout_s, 1)):
            if value is not None and value < low:
                raise UserError(f"hardware.{name}={value} must be at least {low}.")
        if not 0 <= node_rank < num_nodes:
            raise UserError(f"hardware.node_rank={node_rank} must be in 0..{num_nodes - 1} (hardware.num_nodes="
                            f"{num_nodes}).")
        if num_nodes > 1 and not rdzv_endpoint:
            raise UserError(f"hardware.num_nodes={num_nodes} needs hardware.rdzv_endpoint=<main machine>:<port>, the "
                            "same on every machine. Fix: e.g. hardware.rdzv_endpoint=10.0.0.1:29500")
        self.device, self.num_processes, self.num_nodes = device, num_processes, num_nodes
        self.mixed_precision = resolve_precision(mixed_precision, self.uses_cuda())
        self._precision_why = ""  # what auto meant, for the start-up line
        if mixed_precision == "auto":
            where = "a GPU" if self.uses_cuda() else "a CPU"
            has = "with" if self.mixed_precision == "bf16" else "without"
            self._precision_why = f" (auto: {where} {has} bf16 matrix units)"
        self.threads_per_process = threads_per_process
        self.threads_settled: int | None = None  # the count this run uses, once decided (threads())
        self.threads_change_numbers = False  # bf16 on a CPU: results depend on the thread count (threads())
        self._threads_why = ""
        self.rdzv_endpoint, self.node_rank, self.timeout_s = rdzv_endpoint, node_rank, timeout_s
        self.compile, self._compile_asked = compile, asked  # resolved (auto decided), and as configured
        self.accelerator: Accelerator | None = None
        self.frozen_held: dict[str, FrozenHolding] = {}  # by name, what prepare_frozen left on this process
        self._sharding = ""  # set by a sharding strategy's prepare(): what this process holds of the policy

    @staticmethod
    def check_options(node: dict[str, Any], where: str = "hardware") -> None:
        """Before anything is built (:func:`rlhf.config.checks.check_config`, with the config node and its key): a
        ``compile`` backend torch does not have."""
        compiling.check_backend(node.get("compile"), where)

    # --- processes ---------------------------------------------------------------------------------------
    def uses_cuda(self) -> bool:
        return self._cuda(self.device)

    @staticmethod
    def _cuda(device: str) -> bool:
        return device == "cuda" or (device == "auto" and torch.cuda.is_available())

    def processes_per_node(self) -> int:
        """How many processes :mod:`rlhf.launch.processes` starts on this machine."""
        if not self.uses_cuda():
            return self.processes_without_gpu(self.num_processes)
        return self.num_processes if self.num_processes is not None else max(1, torch.cuda.device_count())

    @classmethod
    def processes_without_gpu(cls, num_processes: int | None) -> int:
        """The processes this option starts on a machine without GPU (``num_processes``, else 1): what a Slurm job
        on a node given no GPU holds CPUs for (:func:`rlhf.launch.slurm.slurm_cpus`)."""
        return num_processes if num_processes is not None else 1

    def threads(self, local_processes: int, resumed: int | None = None,
                busy: float | Callable[[], float | None] | None = None, bf16: bool | None = None) -> int:
        """Torch threads per process, decided by the first call and kept (:attr:`threads_settled`; a later call's
        arguments change nothing): ``threads_per_process``, else ``OMP_NUM_THREADS``, else ``resumed`` (the count a
        resumed bf16 run used), else the job's CPUs shared out between its processes on this machine, leaving out
        those that other work keeps busy (``busy``: a sweep's one measurement; else measured as the run starts,
        :func:`rlhf.hardware.cpus.busy_cpus`; not inside a Slurm job, whose CPUs are its own) unless the run computes
        in bf16 on a CPU, whose numbers depend on the count (:func:`rlhf.hardware.cpus.choose_threads`; ``bf16``:
        :func:`rlhf.hardware.precision.computes_in_bf16` of the run's config, else this option's mixed precision). Why, when it is not the
        plain share, is said in the start-up line."""
        if self.threads_settled is None:
            bf16 = self.mixed_precision == "bf16" if bf16 is None else bf16
            self.threads_change_numbers = bf16 and not self.uses_cuda()
            self.threads_settled, self._threads_why = cpus.choose_threads(
                self.threads_per_process, local_processes, resumed=resumed, busy=busy,
                follow_load=not self.threads_change_numbers)
        return self.threads_settled

    # --- the Accelerator -----------------------------------------------------------------------------------
    def start(self, seed: int = 0) -> Accelerator:
        """Build this process's Accelerator (joining the process group when there are several processes).

        Accelerate keeps its state in process-wide singletons; each call starts from a clean one so that
        several ``train()`` calls in one process each get the hardware their config asks for (tested in
        tests/hardware). The process group, once created, is reused. ``seed`` orders the training data (the same
        permutation on every process, each taking its shard).
        """
        if self.uses_cuda() and not torch.cuda.is_available():
            raise UserError("hardware.device=cuda but torch sees no GPU. Fix: hardware=cpu (or cpu_ddp), or install "
                            "a CUDA build of torch.")
        # DeepSpeed, when installed, is imported by Accelerate (e.g. while saving); tell it the device up front or
        # it prints a guess on every rank.
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if self.uses_cuda() else "cpu")
        AcceleratorState._reset_state()
        self.accelerator = Accelerator(
            # cpu=True whenever CUDA is not used: otherwise Accelerate reports one process under torchrun on a
            # CPU-only machine and every rank trains its own copy.
            cpu=not self.uses_cuda(),
            mixed_precision=self.mixed_precision,
            # non_blocking on a GPU: a batch (pinned by the loader, rlhf.data.loaders) is copied without a wait
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=seed,
                                                      non_blocking=self.uses_cuda()),
            kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=self.timeout_s))],
        )
        # After the Accelerator, which sets its own count (from the node's cores) for several CPU processes.
        torch.set_num_threads(self.threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        return self.accelerator

    def describe(self) -> str:
        acc = self.accelerator
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        kind = f"{type(self).__name__}, {_IN_WORDS.get(acc.distributed_type.value, acc.distributed_type.value)}" \
            if acc.num_processes > 1 else "one process"
        precision = "no mixed precision" if self.mixed_precision == "no" else f"{self.mixed_precision} mixed precision"
        precision += self._precision_why
        if self.threads_change_numbers:  # docs/threads/: float32 steps are the same at any count
            precision += (f" (on a CPU, bf16 results depend on the thread count: hardware.threads_per_process="
                          f"{torch.get_num_threads()} repeats them)")
        precision += compiling.describe_compile(self.compile, self._compile_asked)
        frozen = "".join(f"; {name}: {held}" for name, held in self.frozen_held.items())
        return (f"{acc.num_processes} process(es) ({kind}) on {acc.device}, {torch.get_num_threads()} thread(s) "
                f"each{self._threads_why}, {local} process(es) on {cpus_available()} CPU(s) here, {precision}{self._sharding}{frozen}")

    def processes(self) -> int:
        """Processes of the whole run: the Accelerator's count once started, else what the launch will start."""
        if self.accelerator is not None:
            return self.accelerator.num_processes
        return self.processes_per_node() * self.num_nodes

    # --- training -------------------------------------------------------------------------------------------
    def prepare_frozen(self, module: torch.nn.Module, name: str = "frozen") -> torch.nn.Module:
        """Put a model that is used but never trained (a reference, a reward model; ``name`` says which) where it
        runs: in eval mode, without gradients, placed by :meth:`_place_frozen` (this class: a whole copy on this
        process's device; FSDP2 and ZeRO-3 shard it like the policy). What this process then holds of it is
        recorded in :attr:`frozen_held` and printed in :meth:`describe`."""
        module.eval().requires_grad_(False)
        placed = self._place_frozen(module)
        compiling.compile_model(self.unwrap(placed), self.compile)
        params = list(self.unwrap(placed).parameters())
        self.frozen_held[name] = FrozenHolding(
            local_elements=sum(local_numel(p) for p in params), total_elements=sum(global_numel(p) for p in params),
            local_bytes=sum(local_numel(p) * p.element_size() for p in params))
        return placed

    def frozen_share(self, quantized: bool = False) -> float:
        """The fraction of a frozen model's parameters (elements and bytes) each process holds once
        :meth:`prepare_frozen` has placed it, predicted before anything is built (for the memory preflight): 1.0
        here, every process a whole copy; 1/processes where the strategy shards it (FSDP2, ZeRO-3). The measured
        value, after the fact: :attr:`frozen_held`. ``quantized``: the frozen model keeps 8-bit weights."""
        return 1.0

    def stored_precision(self) -> StoredPrecision:
        """How the policy's state is stored beside what was loaded (for the memory preflight): data parallel
        trains the parameters as loaded, with optimizer states in their dtype."""
        return StoredPrecision()

    def _place_frozen(self, module: torch.nn.Module) -> torch.nn.Module:
        """A whole copy on this process's device, its forward under the same autocast as the policy's
        (``mixed_precision``); under bf16 its linear layers' float32 weights are stored in bf16, as autocast would
        cast them on every forward (:func:`~rlhf.hardware.holding.linear_weights_to_bf16`: the same outputs), unless
        some of its layers are the policy's own (``algo/reference=shared_layers``: the policy's weights, saved with
        it, stay as loaded)."""
        module = module.to(self.accelerator.device)
        if self.mixed_precision == "bf16":
            if not getattr(module, "rlhf_shared_layers", 0):  # rlhf.models.reference.SharedLayers
                linear_weights_to_bf16(module)
            autocast = torch.autocast(device_type=self.accelerator.device.type, dtype=torch.bfloat16)
            module.forward = autocast(module.forward)
        return module

    def sharded_state(self) -> frozenset[str]:
        """What this strategy splits over its processes, of ``weights``, ``gradients`` and ``optimizer`` (the
        policy's; read by the memory preflight, :mod:`rlhf.telemetry.memory_preflight`). Data parallel: nothing, each process holds all."""
        return frozenset()

    def empty_cache(self) -> None:
        """Collect garbage and give the device's cached memory back (``train.empty_cache_every_steps``)."""
        gc.collect()
        if self.accelerator.device.type == "cuda":
            torch.cuda.empty_cache()

    def prepare(self, model, make_optimizer, train_loader):
        """Wrap the model for this hardware, build its optimizer with ``make_optimizer(model)`` and shard the
        training loader; return ``(model, optimizer, train_loader)``. The scheduler is built on that optimizer."""
        model, optimizer, train_loader = self.accelerator.prepare(model, make_optimizer(model), train_loader)
        compiling.compile_model(self.unwrap(model), self.compile)  # in place, inside DDP's wrapper: DDP calls the compiled module
        return model, optimizer, train_loader

    @contextlib.contextmanager
    def accumulate(self, model, sync: bool) -> Iterator[None]:
        """Around one micro-batch: gradients are averaged across processes only when ``sync`` (the last one)."""
        with self.accelerator.no_sync(model) if not sync else contextlib.nullcontext():
            yield

    def backward(self, loss: torch.Tensor, model) -> None:
        self.accelerator.backward(loss)

    def clip_gradients(self, model, max_grad_norm: float | None) -> torch.Tensor | None:
        """The global gradient norm before clipping, a tensor on the device (computed, and returned, even when
        ``max_grad_norm`` is None: the loop checks it is finite); clip to ``max_grad_norm`` when set. ``None`` when
        the norm is known only after the step (ZeRO)."""
        limit = float("inf") if max_grad_norm is None else max_grad_norm  # inf: the norm only, gradients x 1.0
        return self.accelerator.clip_grad_norm_(model.parameters(), limit)

    def step(self, model, optimizer, skip: torch.Tensor | None = None) -> float | None:
        """Step the optimizer and zero the gradients; return the gradient norm when only the step knows it.
        ``skip``: a float32 flag on the device, 1 where the step is not finite, given only where
        :meth:`skip_flag_reader` names an optimizer (which reads it, :func:`rlhf.optim.skips_on_device`): the update
        is made or left out on the device, and the host never reads the flag."""
        if skip is None:
            optimizer.step()
        else:
            reader = self.skip_flag_reader(optimizer)
            reader.found_inf = skip  # the attribute torch's GradScaler sets for the same purpose
            try:
                optimizer.step()
            finally:
                del reader.found_inf
        optimizer.zero_grad(set_to_none=True)
        return None

    def skip_flag_reader(self, optimizer) -> torch.optim.Optimizer | None:
        """The torch optimizer that :meth:`step` calls, to be given a ``skip`` flag (the one inside Accelerate's
        wrapper): on one process (several read their flags' all-reduce anyway) that holds its whole state (nothing
        sharded) and steps without a loss scaler (which sets the flag itself); else None."""
        if self.accelerator.num_processes > 1 or self.sharded_state() or getattr(optimizer, "scaler", None) is not None:
            return None
        return getattr(optimizer, "optimizer", optimizer)

    def skip_step(self, model, optimizer) -> None:
        """Drop this step's gradients without changing the parameters (a non-finite loss or gradient)."""
        optimizer.zero_grad(set_to_none=True)

    # --- saving -------------------------------------------------------------------------------------------
    def unwrap(self, model) -> torch.nn.Module:
        """The model inside DDP's (or DataParallel's) wrapper; the model itself when it has none. What
        ``Accelerator.unwrap_model`` does for these two, without its check for DeepSpeed, which imports DeepSpeed
        where it is installed (about 0.2 s of a run's start-up); ZeRO overrides this method."""
        while isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        return model

    def save_state(self, model, optimizer, folder: Path) -> None:
        """Write the model's and the optimizer's state for an exact resume into ``folder`` (every process calls
        it). Replicas: the main process writes ``model.safetensors`` and ``optimizer.pt``. A model with frozen
        parameters (a LoRA adapter on its base, shared layers) saves only those that train, and a fingerprint of
        the rest in the file's metadata (:func:`rlhf.hardware.frozen.save_trainable`): the frozen base comes
        from the run's config again, and a resume checks it is the same. Raises OSError on the ranks whose write
        failed (a full disk): :func:`rlhf.run.checkpoint.save` sums that over the ranks, so every strategy must
        return on every rank, never leave one waiting in a collective."""
        if self.accelerator.is_main_process:
            unwrapped = self.unwrap(model)
            if all(p.requires_grad for p in unwrapped.parameters()):
                save_safetensors(unwrapped, folder / "model.safetensors")
            else:
                save_trainable(unwrapped, folder / "model.safetensors")
            save_torch(optimizer.state_dict(), folder / "optimizer.pt")

    def load_state(self, model, optimizer, folder: Path) -> None:
        """Restore what :meth:`save_state` wrote, on every process."""
        from safetensors.torch import load_model

        device = self.accelerator.device
        unwrapped, file = self.unwrap(model), folder / "model.safetensors"
        if is_trainable_only(file):
            load_trainable(unwrapped, file)
        else:
            load_model(unwrapped, str(file), device=str(device) if device.type != "cpu" else "cpu")  # not "cpu:0"
        # Loaded on the CPU: load_state_dict moves each state to its parameter's device.
        optimizer.load_state_dict(torch.load(folder / "optimizer.pt", weights_only=True, map_location="cpu"))

    def all_finite(self, model) -> bool:
        """Whether every parameter that trains is finite, on every process (before anything is saved). Frozen ones
        cannot turn non-finite, and need not be floats (a 4-bit base's packed weights, stored as any dtype)."""
        pairs = zip(self.unwrap(model).parameters(), self.local_parameters(model))  # local: a shard, ZeRO's own tensor
        bad = any(not torch.isfinite(local.detach()).all() for param, local in pairs if param.requires_grad)
        return not any_process({"nonfinite": bad}, self.accelerator)["nonfinite"]

    def local_parameters(self, model) -> list[torch.Tensor]:
        """The parameter tensors this process stores (its shards for the sharded strategies)."""
        return list(self.unwrap(model).parameters())

    def full_state_dict(self, model) -> dict[str, torch.Tensor] | None:
        """The whole model's weights on the main process (``None`` elsewhere). Called on every process."""
        return None  # replicas: save_pretrained reads the unwrapped model itself

    def save_model(self, model, tokenizer, folder: Path, save_fn: Any) -> None:
        """Write one whole Hugging Face model to ``folder`` (main process), via ``save_fn(model, tokenizer,
        folder, state_dict)``. Called on every process: sharded strategies gather first."""
        state_dict = self.full_state_dict(model)
        if self.accelerator.is_main_process:
            if state_dict is not None:
                state_dict = without_tied_copies(self.unwrap(model), state_dict)
            save_fn(self.unwrap(model), tokenizer, folder, state_dict)
        self.accelerator.wait_for_everyone()
