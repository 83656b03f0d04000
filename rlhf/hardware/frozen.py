"""Checkpoints of a model that trains only some of its parameters (a LoRA adapter on a frozen, maybe 4-bit base;
shared frozen layers): ``model.safetensors`` then holds the parameters that train, and in its metadata a
fingerprint (SHA-256) of everything else the model's ``state_dict`` holds (frozen weights, buffers, bitsandbytes'
quantization constants). A resume builds the frozen part again from the run's config, checks that its fingerprint
is the checkpoint's (a Hub model updated since, another quantization: refused), and loads the trained part.

Why not the whole model, as for full fine-tuning: a QLoRA base's 4-bit layers save extra quantization entries that
``safetensors.torch.load_model`` refuses, and a 7B base would be written again at every checkpoint for a few MB
of adapter.
"""

from __future__ import annotations

import hashlib
import os
import weakref

import torch

from rlhf.core.errors import UserError

KIND = "trainable-only"  # the file's metadata "rlhf" entry
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its frozen part's fingerprint


def trainable(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def frozen_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of every ``state_dict`` entry that is not a trained parameter: names, dtypes, shapes and bytes.
    Computed once per model (the frozen part never changes while it trains)."""
    if model in _fingerprints:
        return _fingerprints[model]
    trained = {id(p) for p in trainable(model).values()}
    digest = hashlib.sha256()
    for name, value in sorted(model.state_dict(keep_vars=True).items()):
        if id(value) in trained or not isinstance(value, torch.Tensor):
            continue
        tensor = value.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}|{tensor.dtype}|{tuple(value.shape)}|".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes())
    _fingerprints[model] = digest.hexdigest()
    return _fingerprints[model]


def save_trainable(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """The trained parameters to ``path`` (safetensors), the frozen part's fingerprint in its metadata. A failed
    write is raised as :class:`OSError`."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tensors = {name: p.detach().cpu().contiguous() for name, p in trainable(model).items()}
    try:
        save_file(tensors, str(path), metadata={"rlhf": KIND, "frozen_sha256": frozen_fingerprint(model)})
    except SafetensorError as error:
        raise OSError(f"writing {path} failed ({error})") from error


def is_trainable_only(path: str | os.PathLike) -> bool:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        return (file.metadata() or {}).get("rlhf") == KIND


def load_trainable(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load what :func:`save_trainable` wrote into ``model``, after checking that its frozen part is the same."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        expected = (file.metadata() or {}).get("frozen_sha256")
        tensors = {name: file.get_tensor(name) for name in file.keys()}
    if expected != frozen_fingerprint(model):
        raise UserError(f"{path}: the frozen weights of the model built for this resume differ from the run's (its "
                        "base model changed since: a new revision on the Hub, another file in its folder, another "
                        "quantization or adapter). Fix: resume with the same base, e.g. model.revision=<the commit "
                        "the run used>.")
    params = trainable(model)
    if params.keys() != tensors.keys():
        missing, extra = sorted(params.keys() - tensors.keys()), sorted(tensors.keys() - params.keys())
        raise UserError(f"{path} does not hold this model's trained parameters (missing: {missing[:3]}, not in the "
                        f"model: {extra[:3]}). Fix: resume with the peft option and model the run used.")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(tensors[name].to(param.device))
