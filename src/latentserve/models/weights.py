"""Copy checkpoint tensors into a model's parameters by name (shared by the model files)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def load_by_name(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 rename: Callable[[str], str | None] = lambda name: name,
                 tied: tuple[str, ...] = ()) -> None:
    """Copy each ``(name, tensor)`` into the parameter ``rename(name)`` (None: skip it);
    loading any of the ``tied`` parameters loads all. Raises KeyError naming an unexpected
    weight, ValueError naming (up to five) missing ones."""
    params = dict(model.named_parameters(remove_duplicate=False))
    seen = set()
    for name, tensor in weights:
        target = rename(name)
        if target is None:
            continue
        if target not in params:
            raise KeyError(f"unexpected weight {target!r} for {type(model).__name__}")
        with torch.no_grad():
            params[target].copy_(tensor)
        seen.add(target)
    missing = set(params) - seen
    if set(tied) & seen:
        missing -= set(tied)
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
