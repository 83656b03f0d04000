"""algo/reference=precomputed (rlhf/models/precomputed.py): the reference's log-probabilities computed once before
training, cached on disk under a key that covers the reference, the data and its tokenization, and no reference
model during training."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
from safetensors.torch import load_file

from rlhf import train
from rlhf.core.instantiate import build
from rlhf.core.train_state import TrainState
from rlhf.models import precomputed
from rlhf.models.precomputed import Precomputed
from rlhf.run.components import build_run
from tests.conftest import FAST, compose_config

SMALL = ["data.task.num_train=16", "data.task.num_eval=8"]


def _built(run_dir, *overrides: str):
    """The run of ``FAST`` + `overrides` built as train() builds it (tokenized, set up, precomputed), not trained."""
    cfg = compose_config(*FAST, *SMALL, "algo=dpo", *overrides, output_dir=run_dir)
    strategy = build(cfg.hardware)
    strategy.start(seed=cfg.seed)
    return build_run(cfg, strategy, run_dir)


def _first_loss(run) -> tuple[float, dict]:
    """The loss of the run's first training batch, the policy moved away from its initial (reference) weights."""
    with torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        for p in run.model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator))
    batch = run.algo.batch_source(run.train_loader, TrainState(), run.accelerator).next()
    return run.algo.loss(run.model, batch)[0].item(), batch


def test_first_step_loss_matches_copy_and_no_reference_model_stays(tmp_path, monkeypatch):
    """The same batch gives copy's loss within 1e-5 (the precomputing batches are padded differently); the reference
    model was built, used and is gone (no reference to it left) before training starts."""
    built = []
    make = Precomputed._reference_model
    monkeypatch.setattr(Precomputed, "_reference_model", lambda self: built.append(weakref.ref(m := make(self))) or m)
    with_copy, _ = _first_loss(_built(tmp_path / "copy", "algo/reference=copy"))
    run = _built(tmp_path / "pre", "algo/reference=precomputed", f"algo.reference.cache_dir={tmp_path / 'cache'}")
    gc.collect()
    assert len(built) == 1 and built[0]() is None, "the reference model is still alive"
    assert run.algo.frozen == {} and run.algo.reference.training_bytes() == 0
    loss, batch = _first_loss(run)
    assert abs(loss - with_copy) < 1e-5 and abs(loss - math.log(2)) > 1e-2
    assert batch["ref_logps"].shape == (2 * 4,)  # chosen then rejected, as the batch's sequences


def test_the_cache_is_reused_and_a_change_of_data_tokenization_or_reference_computes_again(tmp_path):
    cache = f"algo.reference.cache_dir={tmp_path / 'cache'}"

    def computed(*overrides: str) -> int:
        return _built(tmp_path / "run", "algo/reference=precomputed", cache, *overrides).algo.reference.computed_rows

    assert computed() == 16 + 8  # both splits
    assert computed("algo.beta=0.5", "optimizer=sgd", "seed=3") == 0  # another sweep point: nothing computed
    assert computed("data.task.num_train=12") == 12  # other training rows; the held-out ones are cached
    assert computed("algo.max_prompt_length=3") == 16 + 8  # another tokenization of the same rows
    assert computed("model.tiny.init_seed=1") == 16 + 8  # another reference
    assert computed("model.tiny.init_seed=1") == 0
    assert len(list((tmp_path / "cache" / "reference_logps").glob("*.safetensors"))) == 2 + 1 + 2 + 2


def test_a_reference_given_by_path_is_scored_and_keyed_by_its_weights(tmp_path):
    """name_or_path: the same first loss as algo/reference=model; new weights in the same folder compute again."""
    policy = build(compose_config(*FAST).model)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.mul_(0.9)
    policy.model.save_pretrained(tmp_path / "ref")
    policy.tokenizer.save_pretrained(tmp_path / "ref")
    path, cache = f"algo.reference.name_or_path={tmp_path / 'ref'}", f"algo.reference.cache_dir={tmp_path / 'cache'}"
    with_model, _ = _first_loss(_built(tmp_path / "model", "algo/reference=model", path))
    run = _built(tmp_path / "pre", "algo/reference=precomputed", path, cache)
    assert run.algo.reference.computed_rows == 24 and abs(_first_loss(run)[0] - with_model) < 1e-5
    with torch.no_grad():
        next(policy.model.parameters()).add_(1e-3)
    policy.model.save_pretrained(tmp_path / "ref")
    assert _built(tmp_path / "again", "algo/reference=precomputed", path, cache).algo.reference.computed_rows == 24


def test_a_cache_file_that_does_not_hold_its_key_is_not_read(tmp_path):
    reference = Precomputed(cache_dir=str(tmp_path))
    path = tmp_path / "k1.safetensors"
    reference._write(path, "k1", torch.ones(3, 2))
    assert torch.equal(reference._read(path, "k1", 3), torch.ones(3, 2))
    path.rename(tmp_path / "k2.safetensors")  # a file under another key's name
    assert reference._read(tmp_path / "k2.safetensors", "k2", 3) is None
    assert reference._read(tmp_path / "k2.safetensors", "k1", 4) is None  # other rows
    (tmp_path / "k3.safetensors").write_bytes(b"\x08\x00\x00")  # damaged
    assert reference._read(tmp_path / "k3.safetensors", "k3", 3) is None


def test_two_writers_of_one_key_at_once_never_show_a_partial_file(tmp_path, monkeypatch):
    """Two sweep points write the same key at once (the second while the first is half-way through its file): a run
    starting at any moment finds the previous whole file, and no temporary file is left."""
    import safetensors.torch

    reference, path, values = Precomputed(cache_dir=str(tmp_path)), tmp_path / "k.safetensors", torch.randn(50, 2)
    reference._write(path, "k", values)
    seen = []

    def slow_save(tensors, filename, metadata=None) -> None:
        data = safetensors.torch.save(tensors, metadata=metadata)
        with open(filename, "wb") as file:
            file.write(data[: len(data) // 2])
            file.flush()
            seen.append(reference._read(path, "k", 50))  # what a run starting now finds
            if len(seen) == 1:
                reference._write(path, "k", values)  # the other sweep point, meanwhile
            file.write(data[len(data) // 2:])

    monkeypatch.setattr(safetensors.torch, "save_file", slow_save)
    reference._write(path, "k", values)
    assert len(seen) == 2 and all(r is not None and torch.equal(r, values) for r in seen)
    assert torch.equal(reference._read(path, "k", 50), values) and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_resume_is_exact_even_when_the_cache_was_deleted(tmp_path):
    """Recomputed values are the same bit for bit (the same batches), so a resume continues the same optimization."""
    common = [*FAST, *SMALL, "algo=dpo", "algo/reference=precomputed", f"algo.reference.cache_dir={tmp_path / 'cache'}",
              "train.max_steps=3", "train.save_every_steps=1", "train.keep_last=null", "optimizer.lr=1e-2",
              "train.eval_at_start=false"]
    train(compose_config(*common, output_dir=tmp_path / "whole"))
    files = {p.name: load_file(p)["logps"] for p in (tmp_path / "cache" / "reference_logps").iterdir()}
    for p in (tmp_path / "cache" / "reference_logps").iterdir():
        p.unlink()
    step_1 = tmp_path / "whole" / "checkpoints" / "step_00000001"
    train(compose_config(*common, f"resume={step_1}", output_dir=tmp_path / "resumed"))
    again = {p.name: load_file(p)["logps"] for p in (tmp_path / "cache" / "reference_logps").iterdir()}
    assert files.keys() == again.keys() and all(torch.equal(files[k], again[k]) for k in files)
    whole, resumed = (load_file(tmp_path / r / "final" / "model.safetensors") for r in ("whole", "resumed"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


@pytest.mark.serial
def test_two_processes_share_the_work_and_the_cache(tmp_path):
    """hardware=cpu_ddp: a split found in the cache is read by the main process and sent to the other; a missing
    one is scored by both processes, each its share of the batches (8 held-out rows in 3 batches: one process gets
    an empty turn), and equals what one process computes."""
    cache = tmp_path / "cache" / precomputed.FOLDER
    common = [*FAST, *SMALL, "algo=dpo", "algo/reference=precomputed", f"algo.reference.cache_dir={tmp_path / 'cache'}",
              "algo.reference.batch_size=3", "train.max_steps=1"]
    train(compose_config(*common, "hardware=cpu", output_dir=tmp_path / "one"))
    one = {p.name: load_file(p)["logps"] for p in cache.iterdir()}
    (held_out,) = [name for name, values in one.items() if values.shape[0] == 8]
    (cache / held_out).unlink()
    train(compose_config(*common, "hardware=cpu_ddp", "hardware.timeout_s=60", output_dir=tmp_path / "two"))
    log = (tmp_path / "two" / "train.log").read_text()
    assert "train split (16 rows): read from" in log and "eval split (8 rows): computed and saved" in log
    torch.testing.assert_close(load_file(cache / held_out)["logps"], one[held_out], rtol=0, atol=1e-6)
