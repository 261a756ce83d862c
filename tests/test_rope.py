"""RoPE strip / re-apply through the model's own rotary code."""

import pytest
import torch

from kvrag.model.cache import cache_kv, empty_cache
from kvrag.model.rope import Rotary
from tiny import ARCHS, LLAMA3_ROPE, YARN_ROPE, tiny_model

ROPES = {"default": None, "llama3": LLAMA3_ROPE, "yarn": YARN_ROPE}


def keys_at(model, ids, start):
    cache = empty_cache()
    pos = torch.arange(start, start + ids.shape[1])[None]
    with torch.no_grad():
        model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
    return [k for k, _ in cache_kv(cache)]


@pytest.mark.parametrize("rope", list(ROPES))
def test_unrotate_inverts_rotate(rope):
    rot = Rotary(tiny_model("llama", rope_scaling=ROPES[rope]))
    k = torch.randn(3, 2, 50, 16)
    pos = torch.arange(1000, 1050)
    assert torch.allclose(rot.unrotate(rot.rotate(k, pos), pos), k, atol=1e-5)
    assert not torch.allclose(rot.rotate(k, pos), k, atol=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("rope", list(ROPES))
def test_rope_free_key_rerotated_equals_key_computed_there(arch, rope):
    """Keys computed at positions a.., stripped, re-rotated to b.. equal keys computed at b.. (<=1e-5)."""
    model = tiny_model(arch, rope_scaling=ROPES[rope])
    rot = Rotary(model)
    ids = torch.randint(0, 250, (1, 40))
    at_a = keys_at(model, ids, 7)
    at_b = keys_at(model, ids, 731)
    pos_a, pos_b = torch.arange(7, 47), torch.arange(731, 771)
    for ka, kb in zip(at_a, at_b):
        moved = rot.rotate(rot.unrotate(ka, pos_a), pos_b)
        assert (moved - kb).abs().max().item() <= 1e-5
    # and the check can fail: without the re-rotation the keys differ
    assert (at_a[0] - at_b[0]).abs().max().item() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keys_are_rotated_in_fp32_and_rounded_once(dtype):
    """rotate/unrotate of bf16/fp16 keys = the fp32 rotation of the same values, rounded once at the end."""
    rot = Rotary(tiny_model("llama", rope_scaling=LLAMA3_ROPE))
    k = torch.randn(3, 2, 50, 16).to(dtype)
    pos = torch.arange(1000, 1050)
    assert torch.equal(rot.rotate(k, pos), rot.rotate(k.float(), pos).to(dtype))
    assert torch.equal(rot.unrotate(k, pos), rot.unrotate(k.float(), pos).to(dtype))
    out = torch.empty_like(k)
    assert rot.rotate(k, pos, out=out) is out and torch.equal(out, rot.rotate(k.float(), pos).to(dtype))


def test_fp32_fast_path_is_kept_and_bit_equal_to_the_models_own_rotation():
    rot = Rotary(tiny_model("qwen3", rope_scaling=LLAMA3_ROPE))
    assert rot._half_split  # verified bit-equal at construction
    k = torch.randn(2, 2, 30, 16)
    cos, sin = rot.cos_sin(torch.arange(500, 530), k)
    assert torch.equal(rot.rotate(k, torch.arange(500, 530)), rot._apply(rot._probe_q(k), k, cos, sin)[1])
