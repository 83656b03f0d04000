"""Everything one run trains with, built once from its config: :func:`build_run` returns a :class:`BuiltRun`.

config groups -> policy, algorithm, data, optimizer, schedule, logger; the hardware strategy (built by the caller,
started before this) places them: frozen models through ``strategy.prepare_frozen``, the policy, its optimizer and
the training loader through ``strategy.prepare``. Nothing here runs a training step.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import set_seed
from omegaconf import DictConfig

from rlhf.algos.base import Algorithm
from rlhf.core import auto_choices
from rlhf.core.errors import UserError
from rlhf.core.instantiate import build, in_a_sweep
from rlhf.data.collate import truncated_rows
from rlhf.data.fingerprint import data_fingerprint
from rlhf.data.loaders import eval_loader, loader_workers, tokenize_once, train_loader
from rlhf.evaluation.generated import NoGenerationEval
from rlhf.hardware import compiling, global_numel
from rlhf.models import attention
from rlhf.models.adapters import NoAdapter
from rlhf.ops.collectives import any_process
from rlhf.optim import partition as partitions
from rlhf.optim import schedule
from rlhf.run.folder import ENVIRONMENT, PARTITION
from rlhf.run.nonfinite import Verdicts, verdicts_for
from rlhf.run.resume_check import record
from rlhf.run.train_settings import TrainSettings
from rlhf.telemetry import mfu as perf
from rlhf.telemetry.load import LoadMeter
from rlhf.telemetry.memory_preflight import (
    MemoryPlan,
    PeakMemory,
    activation_bytes,
    available_bytes,
    check_fits,
    measured_plan,
    output_layer_bytes,
    resident_bytes,
)
from rlhf.telemetry.metrics import evaluate
from rlhf.telemetry.optimizer_state import bytes_per_parameter

log = logging.getLogger(__name__)


def auto_keys(algo: Any, strategy: Any, configured: dict[str, Any] | None = None) -> list[str]:
    """The speed options of :data:`rlhf.core.auto_choices.CHOICES` this run left to the table (the algorithm's and
    the hardware strategy's as configured, and the values of ``configured``: ``train.*``/``data.*`` keys), for the
    start-up line."""
    owners = {"algo": algo, "hardware": strategy}
    # a strategy that cannot compile (the sharding ones) is not compiled whatever auto means (its line says so)
    values = {"hardware.compile": getattr(strategy, "_compile_asked", None) if strategy.compiles else None,
              **(configured or {})}
    missing = object()
    return [key for key, choice in auto_choices.CHOICES.items()
            if values.get(key, getattr(owners.get(key.split(".")[0]), key.split(".")[1], missing)) == choice.auto_value]


@dataclass
class BuiltRun:
    """One run's components, placed on its hardware. ``max_steps`` is the run's length in optimizer steps (from
    ``train.max_steps`` or ``train.num_epochs``); ``accumulation`` the micro-batches per step on each process."""

    settings: TrainSettings
    run_dir: Path
    strategy: Any  # rlhf.hardware.DataParallel or a subclass
    accelerator: Any
    model: Any  # wrapped by the strategy; strategy.unwrap(model) is the Hugging Face model
    tokenizer: Any
    algo: Algorithm
    optimizer: Any
    scheduler: Any
    train_loader: Any
    eval_loader: Any
    accumulation: int
    max_steps: int
    rows: dict[str, int]  # training and held-out rows after tokenization
    truncated: dict[str, int]  # training rows truncation cut (rlhf.data.collate.truncated_rows)
    skipped_rows: int  # bad rows left out by data.on_bad_row=skip
    resume_record: dict[str, Any]  # what each checkpoint records for resumes (config.json, rlhf.run.resume_check)
    memory: MemoryPlan  # the preflight: what one process is predicted to hold (rlhf.telemetry.memory_preflight)
    adapter: Any  # the peft option (rlhf.models.adapters): writes final/merged/ after final/
    peak: PeakMemory  # the measured peak, counted from just before anything of the run was built
    flops_per_token: float  # model FLOPs of one trained token, for perf/mfu (rlhf.telemetry.mfu.flops_per_token)
    peak_flops: float  # FLOP/s one process of this machine reaches in the run's precision (rlhf.telemetry.mfu.peak_flops)
    generation_eval: Any = None  # the eval option (rlhf.evaluation.generated): eval/gen/* beside the algorithm's
    left_out: frozenset[str] = frozenset()  # the algorithm's answer metrics, on data without one answer per prompt
    verdicts: Verdicts | None = None  # the non-finite verdicts kept on the device; None: read every step (rlhf.run.nonfinite)
    load: LoadMeter = field(default_factory=LoadMeter)  # the machine's load, read at each log window (perf/busy_cpus_other)
    configured_workers: int | None = None  # data.num_workers as configured (None: the table's choice for the device)
    partition: Any = None  # which tensors each update rule steps (rlhf.optim.partition.Split): logged and recorded

    def evaluate(self) -> dict[str, float]:
        """The held-out metrics: the algorithm's own (``eval/<name>``) and the generation evaluation's
        (``eval/gen/...``, with ``eval=generate``)."""
        metrics = self.shown(evaluate(self.model, self.algo, self.eval_loader, self.accelerator), "eval/")
        return {**metrics, **(self.generation_eval(self.model, self.accelerator) if self.generation_eval else {})}

    def shown(self, metrics: dict[str, float], prefix: str) -> dict[str, float]:
        """``metrics`` without those :attr:`left_out` (``<prefix><name>``)."""
        return {k: v for k, v in metrics.items() if k.removeprefix(prefix) not in self.left_out}

    def describe(self) -> None:
        """Log what is about to happen: the folder, the hardware, the batch arithmetic, the model's size."""
        settings, processes = self.settings, self.accelerator.num_processes
        parameters = list(self.strategy.unwrap(self.model).parameters())
        total = sum(global_numel(p) for p in parameters)  # ZeRO-3 keeps empty local tensors
        trainable = sum(global_numel(p) for p in parameters if p.requires_grad)
        log.info("run dir: %s", self.run_dir)
        log.info("hardware: %s", self.strategy.describe())
        autos = auto_keys(self.algo, self.strategy, {"train.nonfinite_on_device": settings.nonfinite_on_device,
                                                     "data.num_workers": self.configured_workers})
        if autos:
            log.info("%s", auto_choices.describe(autos, self.accelerator.device.type))
        epochs = self.epochs()
        log.info("global batch %d = %d per device x %d process(es) x %d accumulation step(s); %d optimizer steps "
                 "(%s epoch(s) of the training rows)", settings.per_device_batch_size * processes * self.accumulation,
                 settings.per_device_batch_size, processes, self.accumulation, self.max_steps, _figure(epochs))
        log.info("parameters: %s (%s trainable); %d training rows, %d held-out rows",
                 f"{total:,}", f"{trainable:,}", self.rows["train"], self.rows["eval"])
        if self.left_out:
            log.info("not logged: %s: they count a completion right only when it is the one answer of the embedded "
                     "task, and this data is of one's own (eval=generate with a reward for it scores completions)",
                     ", ".join(f"{split}/{name}" for name in sorted(self.left_out) for split in ("train", "eval")))
        if epochs > EPOCHS_WARNING and settings.num_epochs is None:
            log.warning("train.max_steps=%d is %s passes over the %d training rows: past a few, a model learns the "
                        "rows themselves, and held-out scores stop telling much. Fix: train.num_epochs=3 (with "
                        "train.max_steps=null), a smaller train.max_steps, or more rows", self.max_steps,
                        _figure(epochs), self.rows["train"])
        if self.rows["eval"] < EVAL_ROWS_WARNING:
            error = 0.5 / math.sqrt(self.rows["eval"])
            log.warning("the held-out split has %d rows: an accuracy measured on them (a share of rows, e.g. "
                        "eval/rewards/accuracies) has a standard error of up to %.2f (0.5/sqrt(%d)), so differences "
                        "below about %.2f between runs are noise. Fix: hold out more rows (data.eval_size=%d, or "
                        "data.eval_split=<a split of their own>)", self.rows["eval"], error, self.rows["eval"],
                        2 * error, EVAL_ROWS_WARNING)
        cut = self.truncated
        if cut["either"]:
            share = cut["either"] / max(1, cut["rows"])
            line = (f"truncation: {cut['either']} of {cut['rows']} training rows ({share:.1%}) cut: {cut['prompt_cut']} "
                    f"prompt(s) longer than algo.max_prompt_length kept their end, {cut['end_cut']} sequence(s) "
                    f"longer than algo.max_length lost their end (data/truncated_rows)")
            if share > TRUNCATION_WARNING:
                log.warning("%s. Fix: a larger algo.max_length / algo.max_prompt_length (the model's context "
                            "allows %s), or shorter rows", line, getattr(self.strategy.unwrap(self.model).config,
                                                                     "max_position_embeddings", "?"))
            else:
                log.info("%s", line)
        log.info("%s", self.memory.describe())
        if self.partition is not None:
            log.info("%s", self.partition.describe(self.optimizer))

    def epochs(self) -> float:
        """Passes over the training rows that ``max_steps`` optimizer steps make."""
        return self.max_steps * self.accumulation / max(1, len(self.train_loader))

    def record_environment(self) -> None:
        """``environment.json`` in the run folder: what a run's numbers depend on beyond its config (the thread
        count and precision it computed in, the machine and torch, the hash of its tokenized training rows), for a
        report that compares runs."""
        if self.accelerator.is_main_process:
            (self.run_dir / ENVIRONMENT).write_text(json.dumps({
                "threads_per_process": torch.get_num_threads(), "mixed_precision": self.strategy.mixed_precision,
                "machine": perf.machine_name(self.accelerator.device), "num_processes": self.accelerator.num_processes,
                "torch": torch.__version__, "cpus": self.load.cpus,  # the CPUs perf/busy_cpus_other counts among
                "threads_change_numbers": getattr(self.strategy, "threads_change_numbers", False),
                "tokenized_data": self.resume_record.get("tokenized_data")}, indent=2) + "\n")  # the rows' hash
            if self.partition is not None:  # which tensors got which rule and lr, for a report to publish
                (self.run_dir / PARTITION).write_text(self.partition.record(self.optimizer))


def _figure(value: float) -> str:
    """3 significant digits, a large figure written out (``5000``, not ``5e+03``)."""
    return f"{value:.0f}" if value >= 1000 else f"{value:.3g}"


TRUNCATION_WARNING = 0.05  # a larger share of training rows cut by truncation is a warning, not an info line
EPOCHS_WARNING = 10  # more passes over the training rows than this (set by max_steps) is a warning
EVAL_ROWS_WARNING = 100  # fewer held-out rows than this is a warning: an accuracy's standard error up to 0.05 and above


def build_run(cfg: DictConfig, strategy, run_dir: Path) -> BuiltRun:
    """Build every component of ``cfg`` on the started ``strategy`` (its Accelerator exists)."""
    accelerator = strategy.accelerator
    peak = PeakMemory(accelerator.device, sweep_point=in_a_sweep())  # before anything of the run is built
    settings = TrainSettings(**cfg.train)  # checked with the rest of the config, before any process started
    accumulation = settings.accumulation_steps(accelerator.num_processes)
    set_seed(cfg.seed)
    adapter = build(cfg.peft) if "peft" in cfg else NoAdapter()
    with accelerator.local_main_process_first():  # e.g. the tiny model's warm start is built once per machine
        policy = build(cfg.model, **adapter.loader_arguments())  # qlora: the base in 4 bits
    # Before the algorithm's setup: a reference made from the policy sees the adapter (or switches it off).
    model, tokenizer = adapter.apply(policy.model, load_base=lambda: build(cfg.model).model), policy.tokenizer
    algo: Algorithm = build(cfg.algo)
    generation_eval = build(cfg.eval) if "eval" in cfg else NoGenerationEval()
    _check_context(getattr(algo, "max_length", None), model.config)
    data = build(cfg.data)
    with accelerator.local_main_process_first():
        splits = data.load(algo.columns, tokenizer, optional=algo.optional_columns)
    tokenized = tokenize_once(splits, algo, tokenizer, accelerator, run_dir / ".cache", keep=getattr(data, "cache_dir", None))
    _check_split_sizes(tokenized, settings, accelerator.num_processes)

    algo.setup(model, tokenizer)  # before prepare(): e.g. the reference copies the initial policy
    generation_eval.setup(model, tokenizer, algo, splits["eval"])  # its own copy of the policy where it needs one
    algo.frozen = {name: strategy.prepare_frozen(module, name=name) for name, module in algo.frozen.items()}
    generation_eval.frozen = {name: strategy.prepare_frozen(module, name=name)
                              for name, module in generation_eval.frozen.items()}
    fingerprint = data_fingerprint(tokenized["train"])  # of the tokens: precomputed columns are the model's
    tokenized = algo.precompute(tokenized, strategy)  # e.g. reference log-probabilities, computed or read once
    collate = compiling.in_buckets(algo.collate, strategy.compile, tokenizer.pad_token_id)  # few lengths compiled
    training = train_loader(tokenized["train"], settings.per_device_batch_size, collate, cfg.seed,
                            num_workers=loader_workers(getattr(data, "num_workers", None), strategy.uses_cuda()),
                            pin_memory=strategy.uses_cuda())  # moved to the GPU without a wait (hardware.base)
    evaluation = eval_loader(tokenized["eval"], settings.eval_batch_size, algo.collate, accelerator)
    # The optimizer is built by the strategy, after sharding (FSDP2 replaces the parameters it shards).
    partition, make_optimizer = partitions.from_config(cfg.optimizer)  # which tensors get which rule, the optimizer
    memory = preflight(model, algo, tokenized["train"], make_optimizer, strategy, settings,
                       frozen={**algo.frozen, **generation_eval.frozen}, split=partition(model))
    check_memory(memory, peak, strategy, settings, memory_fixes(algo, model, settings, accumulation))
    split: list[partitions.Split] = []  # the partition of the parameters the strategy gives the optimizer

    def optimizer_of(module):
        split.append(partition(module))
        return split[-1].build(make_optimizer)

    model, optimizer, training = strategy.prepare(model, optimizer_of, training)
    max_steps = settings.steps(len(training), accumulation)
    scheduler = schedule(build(cfg.scheduler), optimizer, max_steps, warn=accelerator.is_main_process)
    policy = strategy.unwrap(model)
    bf16 = strategy.mixed_precision == "bf16" or next(policy.parameters()).dtype == torch.bfloat16
    with accelerator.local_main_process_first():  # measured once per machine, by one process, then cached
        peak_flops = perf.peak_flops(accelerator.device, torch.bfloat16 if bf16 else torch.float32)
    return BuiltRun(settings, run_dir, strategy, accelerator, model, tokenizer, algo, optimizer, scheduler,
                    training, evaluation, accumulation, max_steps,
                    rows={split: len(tokenized[split]) for split in ("train", "eval")}, skipped_rows=data.skipped_rows,
                    truncated=truncated_rows(tokenized["train"]),
                    resume_record=record(cfg, strategy, fingerprint), memory=memory,
                    adapter=adapter, peak=peak, flops_per_token=perf.flops_per_token(policy, list(algo.frozen.values())),
                    peak_flops=peak_flops, generation_eval=generation_eval,
                    left_out=frozenset(() if getattr(data, "one_answer_per_prompt", True) else algo.answer_metrics),
                    verdicts=verdicts_for(settings, strategy, optimizer),
                    configured_workers=getattr(data, "num_workers", None), partition=split[-1])


def activation_checkpointing(model) -> bool:
    """Whether ``model`` recomputes activations in its backward pass (transformers 5's name, or the name before)."""
    value = getattr(model, "is_activation_checkpointing", None)  # a PeftModel passes it on to its base
    return bool(getattr(model, "is_gradient_checkpointing", False) if value is None else value)


def preflight(model, algo: Algorithm, rows, make_optimizer, strategy, settings: TrainSettings,
              frozen: dict[str, Any] | None = None, split: partitions.Split | None = None) -> MemoryPlan:
    """The memory preflight (:mod:`rlhf.telemetry.memory_preflight`) of this run, for one process: the activations
    are estimated for a micro-batch of the longest rows (of the first 1000), as the algorithm collates them;
    ``frozen``: the frozen models held (default: the algorithm's)."""
    sample = rows.select(range(min(len(rows), 1000)))
    sizes = [sum(len(v) for v in row.values() if isinstance(v, list)) for row in sample]
    longest = sorted(range(len(sizes)), key=sizes.__getitem__)[-settings.per_device_batch_size:]
    sequences, tokens = algo.micro_batch_shape(algo.collate([sample[i] for i in longest]))
    precision = strategy.mixed_precision
    value_bytes = 2 if precision == "bf16" else next(model.parameters()).element_size()
    bf16 = precision == "bf16" or next(model.parameters()).dtype == torch.bfloat16
    device = strategy.accelerator.device
    activations = activation_bytes(model.config, sequences, tokens, value_bytes,
                                   checkpointing=activation_checkpointing(model),
                                   output_layer=output_layer_bytes(model, device, sequences * tokens, value_bytes),
                                   attention_bytes=attention.kept_bytes(model.config, tokens, device.type, bf16))
    precision = strategy.stored_precision()
    trainable = next((p for p in model.parameters() if p.requires_grad), None)
    state_dtype = precision.optimizer_dtype or (trainable.dtype if trainable is not None else torch.float32)
    return measured_plan(model, algo.frozen if frozen is None else frozen, bytes_per_parameter(make_optimizer, state_dtype, split),
                         strategy.sharded_state(), strategy.accelerator.num_processes, activations, precision)


def memory_fixes(algo: Algorithm, model, settings: TrainSettings, accumulation: int) -> list[str]:
    """What lowers a run's memory, in the order to try it: half the micro-batch with twice the accumulation (the
    same global batch), recomputed activations, shorter completions (online algorithms), a sharded strategy."""
    fixes = []
    batch = settings.per_device_batch_size
    if batch > 1:
        keep = "" if settings.global_batch_size is not None else f" train.grad_accumulation_steps={2 * accumulation}"
        fixes.append(f"train.per_device_batch_size={batch // 2}{keep} " + (
            "(the same global batch)" if batch % 2 == 0 else "(a smaller global batch: the batch size is odd)"))
    if not activation_checkpointing(model):
        fixes.append("model.gradient_checkpointing=true (activations recomputed: about a third more compute)")
    length = getattr(algo, "max_completion_length", None)
    if isinstance(length, int) and length > 1:
        fixes.append(f"algo.max_completion_length={length // 2}")
    fixes.append("a sharded strategy over several processes or GPUs (hardware=fsdp or hardware=zero3)")
    return fixes


def check_memory(memory: MemoryPlan, peak: PeakMemory, strategy, settings: TrainSettings, fixes: list[str]) -> None:
    """``train.memory_check``: where the preflight's prediction is more than a process can have (on any process; a
    collective), ``refuse`` stops every process before the first step with the fixes, ``warn`` says so and goes on.
    What a process holds already (its model) counts as had: on a GPU what torch's allocator reserved, on a CPU its
    growth since the run began to be built."""
    if settings.memory_check in ("off", False):  # YAML reads a bare off as false
        return
    accelerator = strategy.accelerator
    device = accelerator.device
    # held already: on a GPU what torch's allocator reserved (the device's free memory leaves it out), on a CPU the
    # process's growth since the run began to be built
    taken = torch.cuda.memory_reserved(device) if device.type == "cuda" else max(0, resident_bytes() - peak.start)
    available, where = available_bytes(device)
    # a CPU's memory is shared by the run's processes on this machine; each GPU is its own process's
    sharers = 1 if device.type == "cuda" else max(1, accelerator.num_processes // max(1, getattr(strategy, "num_nodes", 1)))
    message = check_fits(memory, taken, available, where, sharers, fixes)
    if not any_process({"short": message is not None}, accelerator)["short"]:
        return
    if settings.memory_check == "refuse":
        raise UserError((message or "another process of this run is predicted not to fit in its memory (its log "
                         "says by how much)") + ". Or train.memory_check=warn to run anyway (the system may stop the "
                        "run without a word when memory runs out), off to skip this check.")
    if message:
        log.warning("%s; going on (train.memory_check=warn)", message)


def _check_context(max_length: int | None, config) -> None:
    """Refuse sequences longer than the model's context (``max_position_embeddings``): positions it was never
    built for train silently on garbage (a learned table raises an index error, rotary ones extrapolate)."""
    context = getattr(config, "max_position_embeddings", None)
    if isinstance(max_length, int) and isinstance(context, int) and max_length > context:
        raise UserError(f"algo.max_length={max_length} is longer than the model's context: it has "
                        f"max_position_embeddings={context} positions. Fix: algo.max_length={context} (and "
                        f"algo.max_prompt_length below it, e.g. {context // 2}), or a model with a longer context.")


def _check_split_sizes(tokenized, settings: TrainSettings, processes: int) -> None:
    if len(tokenized["train"]) < settings.per_device_batch_size * processes:
        raise UserError(f"the training split has {len(tokenized['train'])} rows, fewer than one batch "
                        f"(train.per_device_batch_size={settings.per_device_batch_size} x "
                        f"{processes} process(es)). Fix: lower the batch size.")
    if len(tokenized["eval"]) < processes:
        raise UserError(f"the held-out split has {len(tokenized['eval'])} rows, fewer than the "
                        f"{processes} processes. Fix: hold out more rows (data.eval_size).")
