"""The tokenized data, kept across runs: a run whose rows, tokenizer, algorithm settings and code are those of an
earlier run loads that run's tokens instead of tokenizing again (``data.cache_dir``; null: tokenize every run).

An entry is the folder ``<cache_dir>/tokenized/<key>`` (``DatasetDict.save_to_disk``), where :func:`key` hashes:

- the rows of every split (:func:`rlhf.data.fingerprint.data_fingerprint`: every value, in order);
- the tokenizer: every file ``save_pretrained`` writes (vocabulary, merges, special tokens, chat template);
- the algorithm: its class and the settings its ``tokenize`` reads (:func:`tokenize_settings`);
- the code: every source file of the ``rlhf`` package, and the versions of ``datasets``, ``tokenizers`` and
  ``transformers`` (an edit of the package tokenizes again once).

An entry is written into a staging folder beside it and renamed into place (:func:`write`): a reader finds a
complete entry or none, a crash leaves only a ``.tmp-*`` folder that no key names (a later write removes it after a
day), and of two runs of a sweep that tokenize the same data at once, the first rename wins and the second keeps
the first's (identical) entry.
Entries are never changed after they are written; delete the folder freely.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlhf.core.errors import UserError
from rlhf.core.file_io import use_umask
from rlhf.data.fingerprint import data_fingerprint

log = logging.getLogger(__name__)

FOLDER = "tokenized"  # under data.cache_dir
PACKAGE = Path(__file__).resolve().parents[1]  # the rlhf package's source
ABANDONED_AFTER_S = 24 * 3600  # a staging folder untouched this long is a killed write's: removed by the next write


def key(splits, algo, tokenizer) -> str:
    """The cache key of ``algo.tokenize`` applied with ``tokenizer`` to every row of ``splits`` (a DatasetDict)."""
    import datasets
    import tokenizers
    import transformers

    blob = json.dumps({
        "rows": {name: [len(split), data_fingerprint(split)] for name, split in splits.items()},
        "algorithm": [f"{type(algo).__module__}.{type(algo).__qualname__}", tokenize_settings(algo)],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "code": [code_version(), datasets.__version__, tokenizers.__version__, transformers.__version__],
    }, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def tokenize_settings(algo) -> dict[str, Any]:
    """The settings of ``algo`` that its ``tokenize`` reads: the attributes named by ``tokenize_reads`` on the
    class that defines ``tokenize`` (:class:`rlhf.algos.base.Algorithm`), or, where that class names none, every
    attribute (a change of any setting then tokenizes again)."""
    owner = next((c for c in type(algo).__mro__ if "tokenize" in vars(c)), type(algo))
    names = vars(owner).get("tokenize_reads")
    values = vars(algo) if names is None else {name: getattr(algo, name) for name in names}
    return {name: _plain(value) for name, value in values.items()}


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` as JSON that is the same in every process and run: an object by its class and attributes."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if hasattr(value, "__qualname__"):  # a function or a class: by its name
        return {"class": kind, "name": f"{getattr(value, '__module__', '')}.{value.__qualname__}"}
    if depth < 3 and hasattr(value, "__dict__"):
        return {"class": kind, **{k: _plain(v, depth + 1) for k, v in vars(value).items()}}
    return {"class": kind}  # what it is, not where it lives in memory


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of every file ``tokenizer.save_pretrained`` writes: all that decides how it tokenizes."""
    digest = hashlib.sha256(type(tokenizer).__qualname__.encode())
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        for path in sorted(Path(folder).rglob("*")):
            if path.is_file():
                digest.update(f"{path.relative_to(folder)}:{path.stat().st_size};".encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def code_version() -> str:
    """A hash of every source file of the ``rlhf`` package (read once per process)."""
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(f"{path.relative_to(PACKAGE)};".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def entry(cache_dir: str | os.PathLike, splits, algo, tokenizer) -> Path:
    """The folder of the entry for these splits, algorithm and tokenizer (which may not exist yet) in ``cache_dir``
    (``~`` is the home folder)."""
    return Path(os.path.expanduser(cache_dir)) / FOLDER / key(splits, algo, tokenizer)


def write(folder: Path, tokenize: Callable[[], Any]) -> None:
    """Tokenize (``tokenize()`` returns the DatasetDict) and save the result as the entry ``folder``, atomically:
    saved into a staging folder beside it, then renamed. Where another run wrote the entry first, theirs stays."""
    import datasets

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(folder.parent)
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder.parent))
    except OSError as error:
        raise UserError(f"cannot write the tokenized data's cache in {folder.parent} ({error}). Fix: "
                        "data.cache_dir=<a writable folder>, or data.cache_dir=null to tokenize on every run") from error
    try:
        tokenized = tokenize()
        datasets.disable_progress_bars()  # saving is not news
        try:
            tokenized.save_to_disk(str(staging))
        finally:
            datasets.enable_progress_bars()
        use_umask(staging)  # mkdtemp makes it 0700: a shared cache needs the umask's modes
        try:
            os.replace(staging, folder)
        except OSError:
            if not folder.is_dir():
                raise
            log.info("tokenized data: another run wrote %s first", folder)  # identical: the same key
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_abandoned(folder: Path, age_s: float = ABANDONED_AFTER_S) -> None:
    """Remove the staging folders in ``folder`` of writes that ended without cleaning up (a killed process): those
    untouched for ``age_s`` seconds (a write in progress takes seconds to minutes)."""
    now = time.time()
    for staging in folder.glob(".tmp-*"):
        with contextlib.suppress(OSError):
            if now - staging.stat().st_mtime > age_s:
                shutil.rmtree(staging, ignore_errors=True)
