"""What ``hardware.compile`` compiles, and how (:func:`resolve_compile`, :func:`compile_model`).

``layers`` is regional compilation (PyTorch's recipe, https://docs.pytorch.org/tutorials/recipes/regional_compilation.html):
each block of the model's stack of repeated blocks (its decoder layers, found as the largest ``nn.ModuleList`` of
modules of one class: :func:`repeated_blocks`) compiled in place with ``nn.Module.compile``. The blocks share one
class and so one compiled graph: the compiler's start-up is one layer's, not the model's; the norms, rotary
embeddings, SwiGLU and residual adds of a layer run fused instead of as separate memory-bound kernels. What lies
outside the blocks runs eagerly: the embedding, the final norm, and the output layer with its tap
(:mod:`rlhf.ops.output_layer`, which reads a module-level request and would break a compiled graph). ``auto`` is
what :data:`rlhf.core.auto_choices.CHOICES` says for the device: nothing, on a CPU (where compiling was measured
slower to start than it saves) and on a GPU until a GPU check measures ``layers`` faster there. ``true`` or a
backend's name compiles each model whole, as before.

While a run compiles, its training batches of right-padded rows (SFT, reward models, DPO's two sequences a pair) are
padded to a multiple of :data:`BUCKET_TOKENS` positions (:func:`rlhf.data.collate.collate_in_buckets`): the compiled
graphs see few lengths, so few recompiles. Layouts with positions of their own (pairs around a shared prompt, packed
rows) keep their lengths; there, as for any length the graphs have not seen, a new length is compiled again once,
after which torch marks it dynamic (its automatic dynamic shapes).
The models' forward passes keep no key-value cache (``config.use_cache=False``; generation asks for one itself),
which would make each layer's graph specific to its index. Generation runs the layers eagerly
(:mod:`rlhf.models.generation`; its own decode step is compiled whole).
"""

from __future__ import annotations

import difflib
import functools
from typing import Any

import torch

from rlhf.core import auto_choices
from rlhf.core.errors import UserError
from rlhf.data.collate import collate_in_buckets

LAYERS = "layers"  # hardware.compile: each repeated block compiled (regional compilation)
AUTO = "auto"  # hardware.compile: what rlhf.core.auto_choices says for the device (nothing, until a GPU measures LAYERS)
BUCKET_TOKENS = 64  # while compiling, training batches are padded to a multiple of this many positions
LAYER_OPTIONS: dict[str, Any] = {}  # torch.compile's options for each block (its defaults: inductor)


def resolve_compile(compile: bool | str, uses_cuda: bool, compiles: bool = True) -> bool | str:
    """What ``hardware.compile`` means here: ``auto`` is the table's choice for the device
    (:func:`rlhf.core.auto_choices.pick`) for a strategy that ``compiles`` (one process, DDP), else ``False``; every
    other value as given."""
    if compile == AUTO:
        return auto_choices.pick("hardware.compile", "cuda" if uses_cuda else "cpu") if compiles else False
    return compile


def check_backend(compile: Any, where: str = "hardware") -> None:
    """Refuse a ``compile`` value that names a backend torch does not have (before anything is built), with the
    closest one it has."""
    if isinstance(compile, str) and compile not in (AUTO, LAYERS):
        import torch._dynamo  # only for a backend named: its import takes seconds

        if compile not in torch._dynamo.list_backends(exclude_tags=()):  # with its debugging ones
            shown = torch._dynamo.list_backends()
            close = difflib.get_close_matches(compile, shown, n=1)
            fix = f"{where}.compile={close[0]}" if close else f"{where}.compile=true (inductor), or one of them"
            raise UserError(f"{where}.compile={compile}: torch.compile has no backend {compile!r} (its backends: "
                            f"{', '.join(shown)}). Fix: {fix}")


def describe_compile(compile: bool | str, asked: bool | str) -> str:
    """The start-up line's words for the resolved ``compile`` (``asked``: the configured value), empty when off."""
    why = " (hardware.compile=auto on a GPU)" if asked == AUTO else ""
    if compile == LAYERS:
        return f", decoder layers compiled (torch.compile of each repeated block){why}"
    if compile:
        return ", models compiled (torch.compile)"
    return ""  # not compiled (auto on a CPU: the start-up line of the auto options says so)


def repeated_blocks(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's stack of repeated blocks: of its ``nn.ModuleList``s whose modules are all of one class, the one
    holding the most parameters (a causal LM's decoder layers, ``model.model.layers`` in transformers' models,
    wherever a wrapper such as PEFT's puts them); ``None`` when it has none."""
    best, most = None, 0
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            held = sum(p.numel() for p in module.parameters())
            if held > most:
                best, most = module, held
    return best


def compile_model(model: torch.nn.Module, compile: bool | str) -> None:
    """Compile ``model`` in place as the resolved ``compile`` says (nothing when it is false): :data:`LAYERS`, each
    of its :func:`repeated_blocks` with :data:`LAYER_OPTIONS`; ``true``, the whole model with torch's default
    backend; a backend's name, the whole model with that backend. ``nn.Module.compile``: state-dict keys unchanged."""
    if not compile:
        return
    if compile == LAYERS:
        blocks = repeated_blocks(model)
        if blocks is None:
            raise UserError(f"hardware.compile=layers: {type(model).__name__} has no stack "
                            "of repeated blocks (an nn.ModuleList of one class) to compile. Fix: hardware.compile=true "
                            "(the whole model) or hardware.compile=false")
        config = getattr(model, "config", None)
        if config is not None:  # no key-value cache in training's forward passes: with one, each layer's graph
            config.use_cache = False  # would be specialised on its index (one graph per layer, not one for all)
        for block in blocks:
            block.compile(**LAYER_OPTIONS)
        return
    model.compile(**({} if compile is True else {"backend": str(compile)}))


def in_buckets(collate, compile: bool | str, pad_id: int | None):
    """``collate`` whose batches are padded to a multiple of :data:`BUCKET_TOKENS` positions when ``compile`` is on
    (:func:`rlhf.data.collate.pad_to_multiple`, the tokens with the tokenizer's ``pad_id``; layouts it cannot pad
    pass unchanged); ``collate`` itself otherwise."""
    if not compile:
        return collate
    return functools.partial(collate_in_buckets, collate, BUCKET_TOKENS, 0 if pad_id is None else pad_id)
