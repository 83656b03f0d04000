"""rlhf/hardware/precision.py: which dtype a run computes in, ``model.dtype=auto`` read from the checkpoint."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from rlhf.hardware.precision import computes_in_bf16, model_dtype
from rlhf.run.resume_check import THREADS, recorded_config
from tests.conftest import compose_config


def _folder(path, config: dict, weights_dtype: torch.dtype | None = None):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
    if weights_dtype is not None:
        save_file({"lm_head.weight": torch.zeros(2, 2, dtype=weights_dtype)}, str(path / "model.safetensors"))
    return path


def test_model_dtype_auto_is_the_checkpoints_own(tmp_path):
    """``auto`` reads the checkpoint: the config's dtype (``torch_dtype`` in configs written before transformers
    4.56), else its weights' dtype; float32 for the embedded model; ``auto`` (counted as bf16) where nothing says
    (red: auto counted as bf16 whatever the checkpoint holds)."""
    f32 = _folder(tmp_path / "f32", {"dtype": "float32"})
    bf16 = _folder(tmp_path / "bf16", {"torch_dtype": "bfloat16"})
    weights_only = _folder(tmp_path / "weights", {}, weights_dtype=torch.bfloat16)
    unknown = _folder(tmp_path / "unknown", {})
    assert model_dtype({"dtype": "auto", "name_or_path": str(f32)}) == "float32"
    assert model_dtype({"dtype": "auto", "name_or_path": str(bf16)}) == "bfloat16"
    assert model_dtype({"dtype": "auto", "name_or_path": str(weights_only)}) == "bfloat16"
    assert model_dtype({"dtype": "auto", "name_or_path": None}) == "float32"
    assert model_dtype({"dtype": "auto", "name_or_path": str(unknown)}) == "auto"
    assert model_dtype({"dtype": "float16", "name_or_path": str(bf16)}) == "float16"  # as given
    assert not computes_in_bf16("no", model_dtype({"dtype": "auto", "name_or_path": str(f32)}))
    assert computes_in_bf16("no", model_dtype({"dtype": "auto", "name_or_path": str(bf16)}))
    assert computes_in_bf16("no", "auto") and computes_in_bf16("bf16", "float32")


def test_a_float32_checkpoint_under_dtype_auto_records_no_thread_count(tmp_path):
    """A CPU run of a float32 checkpoint under ``model.dtype=auto`` computes in float32, whose numbers do not depend on
    the thread count: its checkpoints record none (so a resume follows the machine's load), as a bf16 checkpoint's do
    (red: auto counted as bf16, the count recorded for both)."""

    class Cpu:
        mixed_precision, threads_settled = "no", 2

        def uses_cuda(self) -> bool:
            return False

        def processes_per_node(self) -> int:
            return 1

    f32 = _folder(tmp_path / "f32", {"dtype": "float32"})
    bf16 = _folder(tmp_path / "bf16", {"dtype": "bfloat16"})
    for folder, recorded in ((f32, False), (bf16, True)):
        cfg = compose_config("hardware=cpu", "model.dtype=auto", f"model.name_or_path={folder}")
        assert (THREADS in recorded_config(cfg, Cpu())) is recorded, folder.name


def test_the_embedded_model_under_dtype_auto_leaves_busy_cpus_out(fast_config, monkeypatch, caplog):
    """The start of a run reads ``auto`` the same way: the embedded model (float32) under ``model.dtype=auto`` on a busy
    machine takes the CPUs left free, as under float32 (red: auto counted as bf16, the idle machine's count kept)."""
    import logging

    from rlhf import train
    from rlhf.hardware import cpus

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setattr(cpus, "cpus_available", lambda: 2)
    monkeypatch.setattr(cpus, "busy_cpus", lambda: 1.0)
    caplog.set_level(logging.INFO, logger="rlhf")
    train(fast_config("model.dtype=auto", "train.max_steps=1"))
    line = next(r.message for r in caplog.records if r.message.startswith("hardware:"))
    assert "1 thread(s) each" in line and "bf16 results depend" not in line, line
