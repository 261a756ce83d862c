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
from kvrag.model.loading import decoder_of


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
        self._half_split = self._is_half_split()

    def cos_sin(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for `positions` (1-D), in fp32 for an exact inverse, shaped [1, seq, dim]."""
        pos = positions.to(device=like.device, dtype=torch.long).reshape(1, -1)
        probe = torch.empty(0, device=like.device, dtype=torch.float32)
        cos, sin = self.rotary_emb(probe, pos)
        return cos.float(), sin.float()

    def rotate(self, keys: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Apply RoPE at `positions` to RoPE-free keys (written into `out` when given)."""
        if keys.shape[-2] == 0:
            return keys if out is None else out.copy_(keys)
        return self.rotate_at(keys, *self.cos_sin(positions, keys), out=out)

    def rotate_at(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`rotate` with cos/sin already computed (`cos_sin`), so a caller rotating many layers or
        chunks at the same positions computes them once. Keys [..., heads, seq, dim]; any leading dims."""
        if self._fast(keys, cos):
            return self._rotate_half_split(keys, cos, sin, out)
        k = keys.float()
        rotated = self._apply(self._probe_q(k), k, cos, sin)[1].to(keys.dtype)
        return rotated if out is None else out.copy_(rotated)

    def _fast(self, keys: torch.Tensor, cos: torch.Tensor) -> bool:
        return self._half_split and keys.dtype == torch.float32 and cos.shape[-1] == keys.shape[-1]

    def rotate_in_place(self, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, max_bytes: int = 256 << 20) -> None:
        """Rotate RoPE-free keys [layers, heads, seq, dim] where they lie, a few layers at a time, so the
        temporaries stay under `max_bytes` whatever the context length; the op count grows with the
        layers, never with how many chunks the span holds."""
        if keys.shape[-2] == 0 or keys.shape[0] == 0:
            return
        per_layer = keys[0].numel() * 4 * 2  # an fp32 copy and its rotation
        step = max(1, min(keys.shape[0], max_bytes // max(1, per_layer)))
        for a in range(0, keys.shape[0], step):
            part = keys[a : a + step]
            # the fast path writes `out` while reading its input: it needs a copy; the model's own path makes one
            self.rotate_at(part.clone() if self._fast(part, cos) else part, cos, sin, out=part)

    @staticmethod
    def _rotate_half_split(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
        """k*cos + rotate_half(k)*sin without the temporaries of cat/neg (the same float ops, so bit-equal)."""
        h = k.shape[-1] // 2
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # [1, 1, seq, dim]: broadcast over heads
        out = torch.mul(k, cos, out=out)
        out[..., :h] -= k[..., h:] * sin[..., :h]
        out[..., h:] += k[..., :h] * sin[..., h:]
        return out

    def _is_half_split(self) -> bool:
        """Use the fast path only if it gives bit-identical keys to the model's own apply_rotary_pos_emb."""
        try:
            dim = int(self.rotary_emb.inv_freq.numel() * 2)
            g = torch.Generator().manual_seed(0)
            k = torch.randn(2, 3, 17, dim, generator=g).to(self.rotary_emb.inv_freq.device)
            cos, sin = self.cos_sin(torch.arange(5, 22), k)
            want = self._apply(self._probe_q(k), k, cos, sin)[1]
            return torch.equal(self._rotate_half_split(k, cos, sin, None), want)
        except Exception:  # any rope variant this check cannot express: the model's own code it is
            return False

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
