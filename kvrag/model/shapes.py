"""Public models' shapes (`kvrag/shapes/NAME.json`: config values, no weights) built with random
weights, so TTFT, memory and the correctness gate can be taken at 1B-8B scale with nothing
downloaded. Random-weight figures are for time, memory and numerics only, never quality."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

import torch

from kvrag.model.loading import LoadedModel, from_model, resolve_device, resolve_dtype


def shape_names() -> list[str]:
    return sorted(p.name[: -len(".json")] for p in resources.files("kvrag").joinpath("shapes").iterdir() if p.name.endswith(".json"))


def shape_config(name: str) -> Any:
    """A transformers config with a public model's shapes (from `kvrag/shapes/NAME.json`)."""
    from transformers import AutoConfig

    path = resources.files("kvrag").joinpath("shapes", f"{name}.json")
    if not path.is_file():
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(shape_names())}")
    spec = json.loads(path.read_text())
    spec.pop("_source", None)
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def random_model(name: str, tokenizer: Any, device: str = "auto", dtype: str = "auto") -> LoadedModel:
    """A model with `name`'s shapes and random weights, built on the target device (no download)."""
    from transformers import AutoModelForCausalLM

    dev = resolve_device(device)
    dt = resolve_dtype(dtype) if dtype != "auto" else (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    cfg = shape_config(name)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with dev:
        model = AutoModelForCausalLM.from_config(cfg, dtype=dt)
    return from_model(model, tokenizer, source=f"random:{name}")
