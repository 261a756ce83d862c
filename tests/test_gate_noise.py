"""The gate's tolerances scale with the model's own noise (kvrag/check/noise.py), and still catch defects.

Run as a script to print the measurement table the multiple was chosen from:
    python tests/test_gate_noise.py [layers ...]      (default: 8 24; bf16 and fp16, init 0.02 and 0.08)
"""

import copy
import json
import sys

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import kvrag.check.checks as check
import kvrag.check.noise as noise
from kvrag import from_model
from kvrag.check.checks import TOLERANCES, check_model
from kvrag.check.gate import gate, verdict_path
from kvrag.model.rope import Rotary
from tiny import LLAMA3_ROPE, tiny_model, tiny_tokenizer

NUMERIC = ("re-rotated keys", "reuse = full (1 chunk)", "recompute 1.0 = full")


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def deep_model(layers=8, hidden=256, arch="llama", rope=LLAMA3_ROPE, init=0.02, seed=0):
    """A random model deep and wide enough for realistic bf16 noise (64-dim heads, GQA, llama3 rope)."""
    tok = tiny_tokenizer()
    cfg = AutoConfig.for_model(
        arch, vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 128), head_dim=64,
        max_position_embeddings=4096, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
        tie_word_embeddings=False, initializer_range=init,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **(rope or {})},
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def deep():
    return from_model(deep_model(), tiny_tokenizer())


# -- the fp32 reference --------------------------------------------------------------------------
def test_fp32_reference_restores_the_weights_and_matches_an_fp32_copy():
    model = tiny_model("qwen2").to(torch.bfloat16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = list(range(20, 90))
    ref = noise.reference_logits(model, ids, "cpu")
    assert all(torch.equal(before[k], v) and before[k].dtype == v.dtype for k, v in model.state_dict().items())
    with torch.no_grad():
        want = copy.deepcopy(model).float()(input_ids=torch.tensor([ids])).logits[0, -1]
        half = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    assert ref.dtype == torch.float32
    assert float((ref - want).norm() / want.norm()) <= 1e-5  # fp32 arithmetic on the bf16 weights
    assert float((half - want).norm() / want.norm()) > 1e-4  # ... which the bf16 pass is not
    with pytest.raises(RuntimeError), noise.fp32_reference(model):  # weights come back even on an error
        model.model.layers[0].register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        model(input_ids=torch.tensor([ids]))
    model.model.layers[0]._forward_pre_hooks.clear()
    assert all(torch.equal(before[k], v) and before[k].dtype == v.dtype for k, v in model.state_dict().items())


def test_tolerance_is_a_multiple_of_the_noise_above_a_floor():
    assert noise.tolerance(0.0, torch.float32, "keys") == 1e-4 == TOLERANCES[torch.float32]["keys"]
    assert noise.tolerance(1e-3, torch.bfloat16, "logits") == noise.FLOORS[torch.bfloat16]["logits"]
    assert noise.tolerance(2e-2, torch.bfloat16, "keys") == pytest.approx(noise.MULTIPLE * 2e-2)
    # past the ceiling the gate refuses: it cannot tell reuse from a defect
    row = check._judge("re-rotated keys", [0.1, 0.1], [1e-3, 0.2], torch.bfloat16, "keys", "")
    assert not row.passed and "too large to verify" in row.message
    # each layer is judged by its own noise: a small error on a quiet layer fails though a noisy layer allows it
    row = check._judge("re-rotated keys", [3e-2, 3e-2], [3e-3, 3e-2], torch.bfloat16, "keys", "")
    assert not row.passed and row.noise == 3e-3 and row.tolerance == pytest.approx(9e-3) and "layer 0" in row.message


def test_noise_floor_unmeasurable_falls_back_to_the_fixed_tolerances(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("no fp32 here")

    monkeypatch.setattr(check, "reference_keys", boom)
    monkeypatch.setattr(check, "reference_logits", boom)
    report = check_model(from_model(tiny_model("llama"), tiny_tokenizer()), dtype="bfloat16")
    assert report.passed, report.table()
    for name in NUMERIC:
        row = report.row(name)
        assert row.noise is None and row.multiple is None
        assert row.tolerance == TOLERANCES[torch.bfloat16]["keys" if name == "re-rotated keys" else "logits"]
    assert "not measured" in report.reference


def test_the_verdict_and_the_table_record_noise_multiple_and_tolerance(home):
    lm = from_model(tiny_model("qwen3").to(torch.bfloat16), tiny_tokenizer())
    report = gate(lm)
    data = json.loads(verdict_path(lm.fingerprint).read_text())["verdicts"]["cpu"]["report"]
    assert "fp32" in data["reference"]
    for row in data["rows"][5:]:
        assert row["noise"] > 0 and row["multiple"] == noise.MULTIPLE
        assert row["tolerance"] == pytest.approx(max(noise.MULTIPLE * row["noise"], noise.FLOORS[torch.bfloat16]["keys"]))
        assert row["error"] <= row["tolerance"]
    table = report.table()
    assert "noise" in table and "tolerance = max(x * noise, floor)" in table
    assert gate(lm).cached and gate(lm).row("re-rotated keys").noise == report.row("re-rotated keys").noise


# -- planted defects, fp32 and bf16 on an 8-layer, 256-wide llama3-rope model ---------------------
def _off_by_one(monkeypatch):
    orig = Rotary.rotate
    monkeypatch.setattr(Rotary, "rotate", lambda self, k, pos, out=None: orig(self, k, pos + 1, out))


def _scaled_keys(monkeypatch):
    orig = Rotary.rotate
    monkeypatch.setattr(Rotary, "rotate", lambda self, k, pos, out=None: orig(self, k, pos, out).mul_(1.05))


def _rope_scaling_ignored(monkeypatch):
    orig = Rotary.__init__

    def init(self, model):
        orig(self, model)
        cfg = copy.deepcopy(model.config)
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_parameters["rope_theta"]}
        self.rotary_emb = LlamaRotaryEmbedding(cfg)  # llama3 rope_scaling dropped at strip and re-rotate

    monkeypatch.setattr(Rotary, "__init__", init)


DEFECTS = {"one position off": _off_by_one, "keys x 1.05": _scaled_keys, "llama3 rope scaling ignored": _rope_scaling_ignored}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_deep_model_passes_without_a_defect(deep, dtype):
    report = check_model(deep, dtype=dtype)
    assert report.passed, report.table()
    if dtype == "bfloat16":  # the tolerance really is the model's noise x MULTIPLE (or the floor)
        for name in NUMERIC:
            r = report.row(name)
            assert r.noise > 1e-3 and r.tolerance == pytest.approx(max(noise.MULTIPLE * r.noise, noise.FLOORS[torch.bfloat16]["keys"]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("defect", list(DEFECTS))
def test_planted_defects_fail_the_gate(deep, dtype, defect, monkeypatch):
    DEFECTS[defect](monkeypatch)
    report = check_model(deep, dtype=dtype)
    print(f"\n{defect} / {dtype}:\n{report.table()}")
    assert not report.passed
    keys = report.row("re-rotated keys")
    assert keys.passed is False and keys.error > 2 * keys.tolerance, report.table()


# -- a deep, noisy model: refused by the old fixed tolerance, passed by the measured one -----------
@pytest.fixture(scope="module")
def noisy():
    """24 layers, init 0.1: its own bf16 logits land ~7e-2 from fp32 (the 8B shape's regime on an H100)."""
    return from_model(deep_model(24, init=0.1), tiny_tokenizer())


def test_a_deep_bf16_model_the_fixed_tolerance_refused_now_passes(noisy):
    report = check_model(noisy, dtype="bfloat16")
    print("\n" + report.table())
    assert report.passed, report.table()
    reuse = report.row("reuse = full (1 chunk)")
    assert reuse.error > TOLERANCES[torch.bfloat16]["logits"]  # the old gate refused this model (measured 5.3e-2 > 3e-2)
    assert reuse.noise > 2 * TOLERANCES[torch.bfloat16]["logits"]  # because its own bf16 noise is that large (7.3e-2)
    assert reuse.error <= reuse.tolerance == pytest.approx(noise.MULTIPLE * reuse.noise)


def test_a_deep_noisy_model_still_fails_a_planted_key_defect(noisy, monkeypatch):
    _scaled_keys(monkeypatch)  # 5% off: the early layers' own noise (~4e-3) keeps the key check strict
    report = check_model(noisy, dtype="bfloat16")
    keys = report.row("re-rotated keys")
    assert not report.passed and keys.passed is False and keys.error > 3 * keys.tolerance, report.table()


# -- measurement table (python tests/test_gate_noise.py) -----------------------------------------
def measure(layers=(8, 24), inits=(0.02, 0.08), dtypes=("bfloat16", "float16"), arch="llama"):
    """reuse error / noise / ratio per numeric check, for random models of each depth and init scale."""
    for n in layers:
        for init in inits:
            lm = from_model(deep_model(n, arch=arch, init=init), tiny_tokenizer())
            for dt in dtypes:
                r = check_model(lm, dtype=dt)
                old = TOLERANCES[getattr(torch, dt)]
                cells = []
                for name in NUMERIC:
                    row = r.row(name)
                    fixed = old["keys" if name == "re-rotated keys" else "logits"]
                    cells.append(f"{row.error:.1e}/{row.noise:.1e} (x{row.error / max(row.noise, 1e-12):.2f}) tol {row.tolerance:.1e} old {'ok' if row.error <= fixed else 'REFUSED'}")
                print(f"{arch} L={n:2d} init={init} {dt:8s} {'PASS' if r.passed else 'FAIL'} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(2)
    measure(tuple(int(a) for a in sys.argv[1:]) or (8, 24))
