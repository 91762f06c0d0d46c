"""The held formats' weights, one module each (catalog/held_formats.py names it): a module
makes a model's matmul weights in its form from the file's blocks or from their values,

    projection_maker(model, held) -> make(layer, proj, weight) -> Projection
        (layer None and proj "lm_head" for the LM head; `weight` the dense parameter,
        empty where the weight is still in its file)
    hold_experts(model, held)         a mixture's experts, from its file or its parameters
    hold_embedding(model, held)       the embedding table (formats with held.embedding)

and engine/held_weights.py runs them in that order (the embedding first)."""

from __future__ import annotations

import importlib
from types import ModuleType

from lucedesk.catalog.held_formats import HeldFormat


def module_of(held: HeldFormat) -> ModuleType:
    return importlib.import_module(held.module)
