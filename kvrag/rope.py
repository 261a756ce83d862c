"""Strip and re-apply rotary position embeddings with the model's own rotary code.

Keys are stored RoPE-free and rotated to their global position at stitch time. The rotation is
done by the model's `rotary_emb` (cos/sin for any rope variant: default, linear, llama3, yarn,
...) and its module's `apply_rotary_pos_emb`, so it can never drift from what the model computes.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

from kvrag.errors import UnsupportedModelError
from kvrag.model import decoder_of


def _default_apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


class Rotary:
    """Rotates keys shaped [batch, kv_heads, seq, head_dim] to or from absolute positions."""

    def __init__(self, model: Any) -> None:
        dec = decoder_of(model)
        self.rotary_emb = getattr(dec, "rotary_emb", None)
        if self.rotary_emb is None:
            raise UnsupportedModelError(f"{type(model).__name__} has no rotary_emb; kvrag needs a RoPE model")
        module = sys.modules.get(type(dec).__module__)
        self._apply: Callable = getattr(module, "apply_rotary_pos_emb", None) or _default_apply

    def cos_sin(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for `positions` (1-D), in fp32 for an exact inverse, shaped [1, seq, dim]."""
        pos = positions.to(device=like.device, dtype=torch.long).reshape(1, -1)
        probe = torch.empty(0, device=like.device, dtype=torch.float32)
        cos, sin = self.rotary_emb(probe, pos)
        return cos.float(), sin.float()

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Apply RoPE at `positions` to RoPE-free keys."""
        if keys.shape[-2] == 0:
            return keys
        cos, sin = self.cos_sin(positions, keys)
        k = keys.float()
        out = self._apply(self._probe_q(k), k, cos, sin)[1]
        return out.to(keys.dtype)

    @staticmethod
    def _probe_q(k: torch.Tensor) -> torch.Tensor:
        """apply_rotary_pos_emb rotates q and k together; give it a one-head q so only k costs."""
        return k.reshape(-1, *k.shape[-2:])[:1].reshape(*([1] * (k.dim() - 2)), *k.shape[-2:])

    def unrotate(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Undo RoPE at `positions`: the inverse rotation, divided by any attention scaling folded into cos/sin."""
        if keys.shape[-2] == 0:
            return keys
        cos, sin = self.cos_sin(positions, keys)
        norm = cos * cos + sin * sin  # = scaling^2 (1 for plain rope); per element, so partial rotary is fine
        k = keys.float()
        out = self._apply(self._probe_q(k), k, cos / norm, -sin / norm)[1]
        return out.to(keys.dtype)
