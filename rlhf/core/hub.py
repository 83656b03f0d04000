"""The Hugging Face Hub, asked in seconds: is offline mode on, can the Hub be reached, is a model in the cache.

Without these checks a Hub id that is not cached fails on a machine without network only after about a minute:
huggingface_hub retries every request five times, with growing pauses. :func:`cache_only` answers first, with one
request of a few seconds at most, and either lets the load go on (from the cache only when the Hub cannot be
reached) or stops it with one message.
"""

from __future__ import annotations

import os

from rlhf.core.errors import UserError

# Seconds the reachability check waits for the Hub's answer.
REACH_TIMEOUT_S = 5.0

_TRUE = {"1", "ON", "YES", "TRUE"}
_reachable: dict[str, bool] = {}  # endpoint -> answer, asked once per process


def offline_mode(datasets: bool = False) -> bool:
    """True when cached files only are asked for: ``HF_HUB_OFFLINE`` (or the older ``TRANSFORMERS_OFFLINE``) in
    the environment now, or when huggingface_hub was imported (it reads them once, then refuses every request);
    for ``datasets``, ``HF_DATASETS_OFFLINE`` decides when it is set."""
    from huggingface_hub import constants

    if datasets and os.environ.get("HF_DATASETS_OFFLINE") is not None:
        return os.environ["HF_DATASETS_OFFLINE"].upper() in _TRUE
    return constants.HF_HUB_OFFLINE or any(os.environ.get(name, "").upper() in _TRUE
                                           for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def endpoint() -> str:
    """The Hub's address (``HF_ENDPOINT``, else huggingface.co)."""
    from huggingface_hub import constants

    return constants.ENDPOINT


def reachable(timeout_s: float = REACH_TIMEOUT_S) -> bool:
    """Whether the Hub answers one request within ``timeout_s`` (through the same HTTP client and proxies as the
    downloads, with no retries). Asked once per process."""
    address = endpoint()
    if address not in _reachable:
        from huggingface_hub.utils import get_session

        try:
            get_session().head(address, timeout=timeout_s)  # any answer, even an error status, means reachable
            _reachable[address] = True
        except Exception:  # DNS failure, refused, timed out, proxy error: all mean "not reachable"
            _reachable[address] = False
    return _reachable[address]


def in_cache(repo_id: str, revision: str | None = None, filename: str = "config.json") -> bool:
    """Whether ``filename`` of the model ``repo_id`` (at ``revision``) is in the local Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, filename, revision=revision), str)
    except ValueError:  # not a valid repository id: not cached
        return False


def _why_unreachable() -> str:
    return "HF_HUB_OFFLINE=1" if offline_mode() else f"no network: {endpoint()} did not answer"


def cache_only(repo_id: str, revision: str | None, key: str) -> bool:
    """Whether to load the Hub model ``repo_id`` from the local cache only (offline mode, or the Hub cannot be
    reached); a :class:`UserError` right away when it must come from the cache and is not there. ``key`` is the
    config key that named it, for the message (``model.name_or_path``)."""
    if not offline_mode() and reachable():
        return False
    if in_cache(repo_id, revision):
        return True
    raise UserError(f"{key}={repo_id}: not in the local Hugging Face cache and the Hub cannot be reached "
                    f"({_why_unreachable()}). Fix: run once with network to download it, or point {key} at a "
                    "local folder.")


def check_dataset_reachable(repo_id: str, key: str) -> None:
    """Stop at once, with one message, when the Hub dataset ``repo_id`` would be fetched from a Hub that cannot be
    reached. In offline mode ``datasets`` answers from its cache in seconds by itself, so nothing is checked."""
    if offline_mode(datasets=True) or reachable():
        return
    raise UserError(f"{key}={repo_id}: the Hub cannot be reached ({_why_unreachable()}). Fix: run once with network "
                    "to download it; if it is in the local cache already, run with HF_HUB_OFFLINE=1 to use that "
                    f"copy; or point {key} at a local file or folder.")
