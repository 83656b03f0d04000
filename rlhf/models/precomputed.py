"""``algo/reference=precomputed``: the reference's log-probabilities computed once, before training, for every row
of the training and held-out splits, and cached on disk; no reference model exists during training.

Before the first step (:meth:`Precomputed.precompute`, called by the algorithm's ``precompute`` hook):

1. every split gets a cache key (:meth:`Precomputed.key`): a hash of the reference's weights and architecture, of
   the split's tokens (the data and its tokenization, row by row), of how a batch is made of a row (the algorithm's
   collate), of the numerics (device type, mixed precision) and of the code (this format's version, rlhf, torch and
   transformers). Anything that changes a log-probability changes the key, so a cache written for other data,
   another tokenization or another reference is never read: it is simply not found.
2. The main process looks for ``<cache_dir>/reference_logps/<key>.safetensors``. A split found there is read and
   sent to every process; the others are computed by all processes together: the reference (a copy of the initial
   policy, or ``name_or_path``) is built, placed by the hardware strategy (``prepare_frozen``: device, autocast,
   shards), and scores fixed batches of rows (sorted by length, so little padding; the same batches whatever the
   number of processes), dealt out to the processes in turn, each with a progress bar on the main process; one
   all-reduce gives every process every row. The main process writes the file under a temporary name and renames
   it into place, so two runs (two sweep points) that compute the same key at once both write whole files and a
   reader never sees a partial one. Then the reference model is deleted.
3. The values become a column of the rows (:data:`COLUMN`, one number per sequence of the row), shuffled and
   sharded with them; :meth:`Precomputed.collate` puts them in each batch and :meth:`Precomputed.logps` hands them
   to the loss instead of a forward pass.

Memory: nothing of the reference stays during training (:meth:`Precomputed.training_bytes` is 0); before training
it needs one reference model plus the activations of one batch of ``batch_size`` rows, before the optimizer's
state exists.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from accelerate.utils import send_to_device
from datasets import DatasetDict
from torch import Tensor
from tqdm.auto import tqdm

from rlhf.core import VERSION
from rlhf.core.file_io import current_umask
from rlhf.core.limits import Range, limits
from rlhf.data.fingerprint import data_fingerprint
from rlhf.models.reference import FrozenCopy, Pretrained, Reference
from rlhf.ops.collectives import from_main_process, sum_over_every_process, sum_over_processes
from rlhf.ops.completion_logps import completion_stats

log = logging.getLogger(__name__)

COLUMN = "ref_logps"  # per row: the reference's summed completion log-probability of each of the row's sequences
BATCH_KEY = "ref_logps"  # in a batch: [S * B], laid out as the algorithm's sequences (sequence k: row k % B)
FORMAT = 1  # bump when the way the values are computed or stored changes: older cache files are then not found
FOLDER = "reference_logps"  # under cache_dir


@limits(batch_size=Range(ge=1, integer=True, meaning="rows per forward pass while precomputing", fix=16))
class Precomputed(Reference):
    """Reference log-probabilities computed once before training, cached on disk, and no reference model during
    training (see the module's docstring for the steps and the cache key).

    Args:
        name_or_path: the reference model (a Hub id or a folder, as ``algo/reference=model`` takes it); ``None``:
            the initial policy, as ``algo/reference=copy``.
        dtype, revision, trust_remote_code: how ``name_or_path`` is loaded (``algo/reference=model``'s fields).
        cache_dir: where cache files are kept (under ``reference_logps/``); shared by runs and sweep points.
        batch_size: rows per forward pass while precomputing (the memory of one batch's activations).
    """

    scores_any_batch = False  # only the sequences of the rows it precomputed

    def __init__(self, name_or_path: str | None = None, dtype: str = "float32", revision: str | None = None,
                 trust_remote_code: bool = False, cache_dir: str = "~/.cache/rlhf", batch_size: int = 16) -> None:
        self.model_source: Reference = (FrozenCopy() if name_or_path is None else
                                        Pretrained(name_or_path, dtype, revision, trust_remote_code))
        self.name_or_path = name_or_path
        self.cache_dir = Path(os.path.expanduser(cache_dir)) / FOLDER
        self.batch_size = batch_size
        self._initial: tuple[torch.nn.Module, Any] | None = None  # (policy, tokenizer) between setup and precompute
        self._loaded: torch.nn.Module | None = None  # the model at name_or_path, between its hash and its use
        self.computed_rows = 0  # rows scored by the reference in this process's last precompute (0: all read)

    # --- the Reference contract ---------------------------------------------------------------------------------
    def __call__(self, policy: torch.nn.Module, tokenizer: Any = None) -> None:
        self._initial = (policy, tokenizer)  # the reference is built later, only if a split is not in the cache
        return None

    def logps(self, batch: dict[str, Tensor], model: torch.nn.Module | None, policy: torch.nn.Module) -> Tensor:
        if BATCH_KEY not in batch:
            raise RuntimeError("algo/reference=precomputed: this batch has no precomputed reference log-probabilities; "
                               "the algorithm's precompute() must run on the rows before they are collated")
        return batch[BATCH_KEY]

    def collate(self, rows: list[dict[str, Any]]) -> dict[str, Tensor]:
        if COLUMN not in rows[0]:  # the rows precompute() scores
            return {}
        per_row = torch.tensor([row[COLUMN] for row in rows], dtype=torch.float32)  # [B, S]
        return {BATCH_KEY: per_row.T.reshape(-1)}  # [S * B]: sequence k is row k % B's

    def training_bytes(self, policy: torch.nn.Module | None = None) -> int:
        """Bytes the reference holds on each device during training (for the memory preflight): none. (The rows'
        column, 4 bytes a sequence, is in host memory with the data.)"""
        return 0

    def memory_bytes(self, policy: torch.nn.Module) -> int:
        """What :meth:`training_bytes` says (the preflight's predictions call every strategy by this name)."""
        return self.training_bytes(policy)

    # --- before training ----------------------------------------------------------------------------------------
    def precompute(self, rows: DatasetDict, strategy, collate: Callable[[list[dict]], dict[str, Tensor]]) -> DatasetDict:
        """``rows`` with :data:`COLUMN` added to every split, read from the cache or computed (every process calls
        it; see the module's docstring)."""
        if self._initial is None:
            raise RuntimeError("algo/reference=precomputed: precompute() before setup(): the initial policy is unknown")
        accelerator = strategy.accelerator
        keys, values, found = {}, {}, {}
        if accelerator.is_main_process:
            reference_hash = self._reference_fingerprint()
            for split in rows:
                keys[split] = self.key(reference_hash, rows[split], collate, strategy)
                values[split] = self._read(self.cache_dir / f"{keys[split]}.safetensors", keys[split], len(rows[split]))
                found[split] = values[split] is not None
        found = {split: flag > 0 for split, flag in
                 sum_over_processes({split: float(found.get(split, False)) for split in rows}, accelerator).items()}
        missing = [split for split in rows if not found[split]]
        self.computed_rows = 0
        if missing:
            computed = self._compute({split: rows[split] for split in missing}, strategy, collate)
            for split in missing:
                values[split] = computed[split]
                if accelerator.is_main_process:
                    self._write(self.cache_dir / f"{keys[split]}.safetensors", keys[split], computed[split])
        out = {}
        for split in rows:
            shared = from_main_process(values.get(split), accelerator) if found[split] else values[split]
            source = "read from" if found[split] else "computed and saved to"
            if accelerator.is_main_process:
                log.info("reference log-probabilities of the %s split (%d rows): %s %s", split, len(rows[split]),
                         source, self.cache_dir / f"{keys[split]}.safetensors")
            out[split] = rows[split].add_column(COLUMN, shared.tolist())
        loaded, self._initial, self._loaded = self._loaded, None, None  # the policy trains from here on
        if loaded is not None:  # name_or_path was loaded for its hash only (every split was in the cache)
            del loaded
            gc.collect()
        return DatasetDict(out)

    def key(self, reference_hash: str, split, collate: Callable, strategy) -> str:
        """The cache key of one split: what its log-probabilities depend on (see the module's docstring)."""
        import transformers

        blob = json.dumps({
            "format": FORMAT, "versions": [VERSION, torch.__version__, transformers.__version__],
            "reference": reference_hash, "rows": data_fingerprint(split), "size": len(split),
            "collate": f"{getattr(collate, '__module__', '')}.{getattr(collate, '__qualname__', repr(collate))}",
            "device": strategy.accelerator.device.type, "precision": getattr(strategy, "mixed_precision", "no"),
        }, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    def _reference_fingerprint(self) -> str:
        """A hash of the reference's weights (names, dtypes, shapes and every byte) and architecture: the initial
        policy, or the model at ``name_or_path`` (loaded, and kept for :meth:`_compute` if a split is missing)."""
        if self.name_or_path is None:
            return model_fingerprint(self._initial[0])
        self._loaded = self._reference_model()
        return model_fingerprint(self._loaded)

    def _compute(self, splits: dict[str, Any], strategy, collate) -> dict[str, Tensor]:
        """``[rows, S]`` float32 log-probabilities of every split in ``splits``, on every process: each scores its
        share of the batches, and one all-reduce sums the shares (each row is non-zero on one process only)."""
        accelerator = strategy.accelerator
        model = strategy.prepare_frozen(self._loaded if self._loaded is not None else self._reference_model())
        self._loaded = None
        try:
            out = {}
            for split, dataset in splits.items():
                values = None
                for indices in tqdm(self._my_batches(dataset, accelerator.process_index, accelerator.num_processes),
                                    desc=f"reference log-probabilities ({split})", dynamic_ncols=True,
                                    disable=not accelerator.is_main_process):
                    scored = indices or [0]  # []: a turn that keeps this process's collectives in step (sharding)
                    batch = send_to_device(collate([dataset[i] for i in scored]), accelerator.device)
                    with torch.no_grad():
                        logps = completion_stats(model, batch).logps.float().view(-1, len(scored)).T  # [B, S]
                    if values is None:
                        values = torch.zeros(len(dataset), logps.shape[1], device=accelerator.device)
                    if indices:
                        values[torch.tensor(indices, device=accelerator.device)] = logps
                        self.computed_rows += len(indices)
                if accelerator.num_processes > 1:
                    values = sum_over_every_process(values)
                out[split] = values.cpu()
            return out
        finally:
            del model
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _reference_model(self) -> torch.nn.Module:
        """The reference, built for the forward passes (a copy of the initial policy, or the model at
        ``name_or_path``), in eval mode and frozen."""
        return self.model_source(*self._initial).eval().requires_grad_(False)

    def _my_batches(self, dataset, rank: int, world: int) -> list[list[int]]:
        """This process's batches of row indices: rows sorted by length (then index) in batches of ``batch_size``,
        dealt out in turn (the same batches on any number of processes); a process with fewer turns than the
        others gets an empty batch to keep step."""
        table = dataset.with_format("arrow")[:]
        lengths = np.zeros(len(dataset), dtype=np.int64)
        for name in table.column_names:  # every token column (ids, masks): sequences' lengths, summed
            if pa.types.is_list(table.schema.field(name).type) or pa.types.is_large_list(table.schema.field(name).type):
                lengths += pc.list_value_length(table[name]).to_numpy(zero_copy_only=False)
        order = sorted(range(len(dataset)), key=lambda i: (int(lengths[i]), i))
        batches = [order[start:start + self.batch_size] for start in range(0, len(order), self.batch_size)]
        mine = batches[rank::world]
        return mine + [[]] * (-(-len(batches) // world) - len(mine))

    # --- the cache files ----------------------------------------------------------------------------------------
    def _read(self, path: Path, key: str, rows: int) -> Tensor | None:
        """The cached ``[rows, S]`` values, or None when there is no (whole, matching) file."""
        from safetensors import safe_open

        if not path.is_file():
            return None
        try:
            with safe_open(str(path), framework="pt") as file:
                metadata = file.metadata() or {}
                values = file.get_tensor("logps")
        except Exception as error:  # a damaged file (another program, a full disk): computed again, replaced
            log.warning("%s could not be read (%s: %s); computing it again", path, type(error).__name__, error)
            return None
        if metadata.get("key") != key or values.dim() != 2 or values.shape[0] != rows:
            log.warning("%s does not hold what its name says (key %s, shape %s); computing it again", path,
                        metadata.get("key"), list(values.shape))
            return None
        return values

    def _write(self, path: Path, key: str, values: Tensor) -> None:
        """Write under a temporary name in the same folder, then rename into place (atomic): a run that computes the
        same key at the same time writes its own temporary file, and the last rename wins with equal values."""
        from safetensors.torch import save_file

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_name(f".{path.stem}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
            try:
                save_file({"logps": values.contiguous()}, str(temporary), metadata={"key": key, "format": str(FORMAT)})
                os.chmod(temporary, 0o666 & ~current_umask())  # safetensors writes 0600
                os.replace(temporary, path)
            finally:
                temporary.unlink(missing_ok=True)
        except OSError as error:  # a cache that cannot be written costs the next run time, not this run
            log.warning("could not cache the reference log-probabilities in %s (%s); the next run computes them "
                        "again", path, error)


def model_fingerprint(model: torch.nn.Module) -> str:
    """A hash of ``model``'s architecture (its config, without where it was loaded from) and of every tensor of its
    state dict (name, dtype, shape, bytes)."""
    digest = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        described = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
        digest.update(json.dumps(described, sort_keys=True, default=str).encode())
    digest.update(type(model).__name__.encode())
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()
