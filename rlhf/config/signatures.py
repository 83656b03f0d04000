"""The arguments a ``_target_`` takes, for checking a config's fields before anything is built: a class's
``__init__`` joined with the ones it forwards ``**kwargs`` to (:func:`signature_of`)."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any


def signature_of(target: Callable) -> tuple[inspect.Signature, dict[str, Any]] | None:
    """The arguments ``target`` takes and their annotations. A class whose ``__init__`` takes ``**kwargs`` passes
    them on to the next ``__init__`` of its method resolution order (the house's convention: ``GRPO(PolicyGradient)``;
    a mixin before an algorithm): its own arguments are joined with that one's, so that a misspelled field is still
    refused."""
    if not inspect.isclass(target):
        try:
            return inspect.signature(target), typing.get_type_hints(target)
        except (TypeError, ValueError, NameError, AttributeError):
            return None
    mro = target.__mro__
    owners = [i for i, c in enumerate(mro) if "__init__" in c.__dict__ and c is not object]
    return _init_signature(mro, owners) if owners else None


def _init_signature(mro: tuple[type, ...], owners: list[int]) -> tuple[inspect.Signature, dict[str, Any]] | None:
    """The signature of ``mro[owners[0]].__init__`` without ``self``, joined with the next owner's when it forwards
    ``**kwargs``."""
    function = mro[owners[0]].__dict__["__init__"]
    try:
        signature = inspect.signature(function)
        hints = typing.get_type_hints(function)
    except (TypeError, ValueError, NameError, AttributeError):
        return None
    signature = signature.replace(parameters=list(signature.parameters.values())[1:])  # self
    forwards = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    if forwards and len(owners) > 1:
        found = _init_signature(mro, owners[1:])
        if found is not None:
            own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
            inherited = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) if p.kind is not inspect.Parameter.VAR_KEYWORD
                         else p for name, p in found[0].parameters.items()
                         if name not in signature.parameters and p.kind is not inspect.Parameter.VAR_POSITIONAL]
            signature = signature.replace(parameters=sorted(own + inherited, key=lambda p: p.kind))
            hints = {**found[1], **hints}
    return signature, hints
