"""Model preparation (peft LoRA, full), the adapter export, the lr schedule and the optimizer state."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from kvrag.defaults import LORA_MODES
from kvrag.link_adapter import LinkAdapter
from kvrag.training.config import TrainConfig


def prepare_model(model: Any, cfg: TrainConfig) -> tuple[Any, list[tuple[str, torch.nn.Parameter]]]:
    """The model to train (peft-wrapped for lora) and its trainable weights (besides the links)."""
    model.requires_grad_(False)
    if cfg.mode in LORA_MODES:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(f"mode {cfg.mode!r} needs peft: pip install 'kvrag[train]' (or pip install peft)") from exc
        targets = [t.strip() for t in cfg.lora_targets.split(",") if t.strip()]
        config = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, target_modules=targets, lora_dropout=0.0, bias="none")
        model = get_peft_model(model, config)
    elif cfg.mode == "full":
        model.requires_grad_(True)
    model.train(False)  # no dropout: a step is a deterministic function of the weights and the batch
    if cfg.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def lora_factors(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """LoRA A/B of a peft model under the base model's module names, and their configuration."""
    from peft.tuners.lora import LoraLayer

    out: dict[str, torch.Tensor] = {}
    cfg: dict[str, Any] = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in getattr(module, "lora_A", {}):
            base = name.removeprefix("base_model.model.")
            out[f"{base}.A"] = module.lora_A["default"].weight.detach().float().cpu().clone()
            out[f"{base}.B"] = module.lora_B["default"].weight.detach().float().cpu().clone()
            cfg = {"r": int(module.r["default"]), "alpha": float(module.lora_alpha["default"]), "scaling": float(module.scaling["default"])}
    return out, cfg


def export_adapter(model: Any, links: torch.Tensor, cfg: TrainConfig, header: dict[str, Any]) -> LinkAdapter:
    """The adapter artifact of the current weights."""
    lora: dict[str, torch.Tensor] = {}
    weights: dict[str, torch.Tensor] = {}
    meta = dict(header)
    if cfg.mode in LORA_MODES:
        lora, lcfg = lora_factors(model)
        meta["lora"] = {**lcfg, "targets": cfg.lora_targets.split(",")}
    elif cfg.mode == "full":
        weights = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    return LinkAdapter(embeds=links.detach().float().cpu().clone(), mode=cfg.mode, lora=lora, weights=weights, meta=meta)


# -- optimisation -------------------------------------------------------------------------------
def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to `min_ratio` of the peak."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_tensors(opt: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """AdamW's state as named tensors (safetensors-friendly: tensors and JSON only)."""
    out: dict[str, torch.Tensor] = {}
    for i, p in enumerate(params):
        st = opt.state.get(p)
        if not st:
            continue
        for k, v in st.items():
            out[f"{i}.{k}"] = (v if torch.is_tensor(v) else torch.tensor(v)).detach().cpu().contiguous()
    return out


def restore_optimizer(opt: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter], tensors: dict[str, torch.Tensor]) -> None:
    for i, p in enumerate(params):
        st = {k.split(".", 1)[1]: v for k, v in tensors.items() if k.split(".", 1)[0] == str(i)}
        if st:
            opt.state[p] = {k: (v.to(p.device) if k != "step" else v) for k, v in st.items()}

