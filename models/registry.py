"""Method name → model class. Each method module is imported only when its name is asked for."""

from __future__ import annotations

import importlib

from models.method import CSEModel

_MODULES = {
    "d2cse": ("models.d2cse", "D2CSE"),
    "simcse": ("models.simcse", "SimCSE"),
    "dcpcse": ("models.dcpcse", "DCPCSE"),
    "diffcse": ("models.diffcse", "DiffCSE"),
    "diffaug": ("models.diffaug", "DiffAug"),
}
METHODS: tuple[str, ...] = tuple(_MODULES)


def model_class(method: str) -> type[CSEModel]:
    if method not in _MODULES:
        raise ValueError(f"unknown method {method!r}; known: {list(METHODS)}")
    module, name = _MODULES[method]
    return getattr(importlib.import_module(module), name)


def build_model(method: str, model_config: dict, backbone=None, tokenizer=None) -> CSEModel:
    """The model of `method` from its config dict (`backbone` key included), loading the backbone if not given."""
    cls = model_class(method)
    return cls(cls.config_class.from_dict(model_config), backbone=backbone, tokenizer=tokenizer)
