"""Metric sinks. Every run writes ``metrics.jsonl`` in its run folder; other sinks add to that."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


class JsonlLogger:
    """Appends one JSON object per call to ``<run dir>/metrics.jsonl``: ``{"step": N, "train/loss": ...}``."""

    def __init__(self, filename: str = "metrics.jsonl") -> None:
        self.filename = filename
        self.path: Path | None = None

    def start(self, run_dir: str, config: dict[str, Any]) -> None:
        self.path = Path(run_dir) / self.filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")  # a new run starts a new file

    def log(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")

    def finish(self) -> None:
        pass


class WandbLogger(JsonlLogger):
    """``metrics.jsonl`` plus Weights & Biases. Runs offline (synced later with ``wandb sync``) when no API key
    is configured, so it works without network.

    Args:
        project: W&B project.
        entity: W&B team or user (``None``: your default).
        name: run name (``None``: the run folder's name).
        tags: run tags.
        mode: ``online``, ``offline`` or ``disabled``; ``None`` picks online if an API key is set.
    """

    def __init__(self, project: str = "rlhf", entity: str | None = None, name: str | None = None,
                 tags: list[str] | None = None, mode: str | None = None) -> None:
        super().__init__()
        self.project, self.entity, self.name, self.tags, self.mode = project, entity, name, tags, mode
        self.run = None

    def start(self, run_dir: str, config: dict[str, Any]) -> None:
        import wandb

        super().start(run_dir, config)
        mode = self.mode or ("online" if os.environ.get("WANDB_API_KEY") or _has_netrc_key() else "offline")
        self.run = wandb.init(project=self.project, entity=self.entity, name=self.name or Path(run_dir).name,
                              tags=self.tags, config=config, dir=run_dir, mode=mode)

    def log(self, metrics: dict[str, float], step: int) -> None:
        super().log(metrics, step)
        self.run.log(metrics, step=step)

    def finish(self) -> None:
        self.run.finish()


def _has_netrc_key() -> bool:
    netrc = Path(os.path.expanduser("~/.netrc"))
    return netrc.exists() and "api.wandb.ai" in netrc.read_text(errors="ignore")
