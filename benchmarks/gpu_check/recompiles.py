"""Torch's recompile limit, watched in every section of the GPU check: past it (``torch._dynamo.config.
recompile_limit``, 8 graphs of one function by default; ``cache_size_limit`` in older torch) a compiled function runs
eagerly from then on, so a speed figure would time the eager path and a correctness row would check it. Dynamo says
so once, in a warning of its logger ``torch._dynamo`` ("torch._dynamo hit config.recompile_limit (8)", then the
function and the last reason); a section in which that warning appears fails, naming it.

- in this process: :class:`RecompileWatch` around the section (a handler on the ``torch._dynamo`` logger);
- in another process whose output is read (a training run of ours): :func:`hits_in` on its output.
"""

from __future__ import annotations

import logging
import re

# The first line of Dynamo's warning (torch/_dynamo/convert_frame.py); "cache_size_limit" in torch before 2.6
LIMIT_HIT = re.compile(r"torch\._dynamo hit config\.(\w*(?:recompile_limit|cache_size_limit))\s*\((\d+)\)")
LOGGER = "torch._dynamo"


class RecompileLimitHit(RuntimeError):
    """A section hit torch's recompile limit; the message names the function and the reason Dynamo gave."""


def hits_in(text: str) -> list[str]:
    """Each recompile-limit warning in ``text`` (a process's output), as its line and the function's line after it."""
    lines = text.splitlines()
    out = []
    for k, line in enumerate(lines):
        found = LIMIT_HIT.search(line)
        if found is None:
            continue
        functions = [x.split("function:", 1)[1].strip() for x in lines[k + 1:k + 3] if "function:" in x]
        out.append(found.group(0) + (f"; {functions[0]}" if functions else ""))
    return out


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001  (a malformed record is not this watch's business)
            return
        self.into.extend(hits_in(message))


class RecompileWatch:
    """Within the block, every recompile-limit warning of torch's compiler is collected (:attr:`hits`); with
    ``fail=True`` the block raises :class:`RecompileLimitHit` at its end when there was one (and nothing else
    raised)."""

    def __init__(self, what: str = "this section", fail: bool = True) -> None:
        self.what, self.fail, self.hits = what, fail, []
        self._handler = _Collect(self.hits)

    def __enter__(self) -> RecompileWatch:
        logging.getLogger(LOGGER).addHandler(self._handler)
        return self

    def __exit__(self, kind, error, trace) -> None:
        logging.getLogger(LOGGER).removeHandler(self._handler)
        if self.fail and error is None and self.hits:
            raise RecompileLimitHit(message(self.what, self.hits))

    def take(self) -> list[str]:
        """The hits so far, and none kept (a long-lived process reports each answer's own)."""
        taken = list(self.hits)
        self.hits.clear()
        return taken


def message(what: str, hits: list[str]) -> str:
    """The failure's words: what hit the limit, each warning, and what to look at."""
    return (f"{what} hit torch's recompile limit (ran eagerly past it): {' | '.join(hits)[:400]}. Look at why it "
            "recompiles: TORCH_LOGS=recompiles")
