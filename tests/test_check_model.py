"""The per-model correctness gate (`kvrag check-model`, `kvrag.check.checks`) and the device/dtype options."""

import argparse
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import kvrag.check.checks as check
import kvrag.check.gate as verdicts
import kvrag.model.loading as kmodel
from kvrag import Chunk, ContextTooLongError, KVRag, UnsupportedModelError, from_model
from kvrag.cache_backends import KVEntry
from kvrag.check.checks import CHECK_CHUNKS, CHECK_QUESTION, TOLERANCES, CheckReport, check_model
from kvrag.check.gate import gate, verdict_path
from kvrag.cli.check import add_check_model_parser
from kvrag.engine import KIND_CHUNK, KIND_PREFIX
from kvrag.kv.layout import PromptLayout
from kvrag.model.loading import resolve_device, resolve_dtype
from kvrag.model.rope import Rotary
from tiny import ARCHS, LLAMA3_ROPE, YARN_ROPE, tiny_model, tiny_tokenizer

NUMERIC = ("re-rotated keys", "reuse = full (1 chunk)", "recompute 1.0 = full")
VARIANTS = {a: (a, None) for a in ARCHS} | {"llama3-rope": ("llama", LLAMA3_ROPE), "yarn-rope": ("llama", YARN_ROPE)}


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """Every test keeps its verdicts in its own $KVRAG_HOME."""
    monkeypatch.setenv("KVRAG_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def lm_of(name="llama", seed=0):
    arch, rope = VARIANTS[name]
    return from_model(tiny_model(arch, seed=seed, rope_scaling=rope), tiny_tokenizer())


def tiny_other(model_type, attn="sdpa", **overrides):
    """A tiny random model of another architecture (same sizes and tokenizer as tests/tiny.py)."""
    tok = tiny_tokenizer()
    cfg = dict(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None, tie_word_embeddings=False,
    )
    cfg.update(overrides)
    config = AutoConfig.for_model(model_type, **cfg)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def check_prompt_tokens() -> int:
    layout = PromptLayout(tiny_tokenizer())
    return layout.segments([layout.chunk_ids(c) for c in CHECK_CHUNKS], CHECK_QUESTION).total_len


# -- passes ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(VARIANTS))
def test_check_passes_on_tiny_models(name):
    report = check_model(lm_of(name))
    assert report.passed, report.table()
    assert [r.name for r in report.rows] == list(check.ROWS)
    for name_ in NUMERIC:
        row = report.row(name_)
        assert row.passed and row.tolerance == TOLERANCES[torch.float32][("keys" if name_ == "re-rotated keys" else "logits")]
        assert 0.0 <= row.error <= 1e-5  # fp32 on a tiny model: rounding only, far under the 1e-4 tolerance
    report.raise_if_failed()  # no-op when it passed


def test_table_names_every_check_with_its_numbers():
    table = check_model(lm_of("qwen2")).table()
    for name in check.ROWS:
        assert name in table
    assert "Qwen2ForCausalLM" in table and "float32" in table and "PASSED" in table
    assert "1.0e-04" in table  # the fp32 tolerance is printed next to each measured error


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_check_passes_in_half_precision_on_cpu_within_its_tolerance(dtype):
    lm = lm_of("llama")
    report = check_model(lm, dtype=dtype)  # checks a converted copy
    assert report.passed, report.table()
    assert report.dtype == dtype and lm.dtype == torch.float32  # the given model is left alone
    for name in NUMERIC:  # judged against the model's own noise in this dtype (vs fp32), times the multiple
        row = report.row(name)
        assert row.noise > 0 and row.multiple == check.MULTIPLE and row.error <= row.tolerance
        assert row.tolerance == max(check.MULTIPLE * row.noise, check.FLOORS[getattr(torch, dtype)]["keys"])
    # half precision really is looser than fp32 (the tolerance is not hiding a zero-cost check)
    assert report.row("re-rotated keys").error > 1e-5


def test_models_whose_context_is_capped_still_pass():
    # a sliding window the check's prompt fits in: prompts are capped at the window
    window = check_prompt_tokens() + 100
    mistral = from_model(tiny_other("mistral", sliding_window=window), tiny_tokenizer())
    report = check_model(mistral)
    assert report.passed, report.table()
    assert mistral.max_context == window and f"capped at {window}" in report.row("sliding window").message
    rag = KVRag(mistral, store="memory://")
    with pytest.raises(ContextTooLongError, match=f"context is {window}"):  # never silently wrong past the window
        rag.answer("What?", chunks=[Chunk("long", "word " * window)])
    # Qwen2 with sliding layers mixed in (was refused at load before the gate existed)
    qwen = from_model(tiny_other("qwen2", use_sliding_window=True, sliding_window=window, max_window_layers=1), tiny_tokenizer())
    assert check_model(qwen).passed and qwen.max_context == window
    # dynamic NTK rope: frequencies change only past max_position_embeddings, which kvrag never exceeds
    dyn = from_model(tiny_other("llama", rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}), tiny_tokenizer())
    report = check_model(dyn)
    assert report.passed and "dynamic" in report.row("rope variant").message and dyn.max_context == 4096


# -- refusals ----------------------------------------------------------------------------------
def test_sliding_window_shorter_than_the_prompt_is_refused_by_name():
    n = check_prompt_tokens()
    lm = from_model(tiny_other("mistral", sliding_window=64), tiny_tokenizer())
    report = check_model(lm)
    assert not report.passed and [r.name for r in report.failed] == ["sliding window"]
    assert all(report.row(name).passed is None for name in NUMERIC)  # skipped, not run
    with pytest.raises(UnsupportedModelError) as err:
        report.raise_if_failed()
    msg = str(err.value)
    assert msg.startswith("kvrag cannot serve user exactly on cpu/float32: failed check sliding window: ")
    assert f"sliding_window=64 is shorter than the check's {n}-token prompt" in msg
    assert "kvrag check-model" in msg and "check=False" in msg
    # the engine refuses it too, with the same message, unless told not to check
    with pytest.raises(UnsupportedModelError, match="failed check sliding window"):
        KVRag(lm, store="memory://")
    KVRag(lm, store="memory://", check=False)


def test_the_numeric_checks_catch_a_sliding_window_on_their_own(monkeypatch):
    """Without the static pre-check (and the context cap), reuse and recompute really differ from Full Attention."""
    lm = from_model(tiny_other("mistral", sliding_window=64), tiny_tokenizer())
    monkeypatch.setattr(kmodel, "context_limits", lambda model: {"positions": (4096, "")})
    rag = KVRag(lm, store="memory://", check=False)
    rag.precompute(list(CHECK_CHUNKS), progress=False)
    rows = {r.name: r for r in check._numeric_rows(lm, rag)}
    assert not rows["reuse = full (1 chunk)"].passed and rows["reuse = full (1 chunk)"].error > 1e-2
    assert not rows["recompute 1.0 = full"].passed and rows["recompute 1.0 = full"].error > 1e-2


def test_a_wrong_rotation_fails_the_key_check(monkeypatch):
    lm = lm_of("llama")
    orig = Rotary.rotate
    monkeypatch.setattr(Rotary, "rotate", lambda self, k, pos, out=None: orig(self, k, pos + 1, out))  # one position off
    report = check_model(lm)
    assert not report.row("re-rotated keys").passed and report.row("re-rotated keys").error > 0.1


def test_partial_rotary_applied_inside_the_attention_module_is_refused():
    """Phi rotates only the first half of each head inside its attention module, which kvrag's
    rotation of whole cached keys cannot reproduce: the key check must fail, naming partial rotary."""
    lm = from_model(tiny_other("phi", partial_rotary_factor=0.5), tiny_tokenizer())
    report = check_model(lm)
    assert not report.passed
    assert report.row("partial rotary").message.startswith("rotary dim 8 of head dim 16")
    assert report.failed[0].name == "re-rotated keys"
    with pytest.raises(UnsupportedModelError, match=r"failed check re-rotated keys: .*\(partial rotary: rotary dim 8 of head dim 16\)"):
        report.raise_if_failed()


def test_attention_sinks_are_refused():
    model = tiny_other("gpt_oss", attn="eager", num_local_experts=4, num_experts_per_tok=2, sliding_window=4096)
    report = check_model(model, tokenizer=tiny_tokenizer())
    assert [r.name for r in report.failed] == ["attention sinks"]
    with pytest.raises(UnsupportedModelError, match=r"failed check attention sinks: learned attention-sink logits \(model\.layers\.0\.self_attn\.sinks\)"):
        report.raise_if_failed()


def test_a_model_without_rope_gets_a_report_not_a_crash():
    tok = tiny_tokenizer()
    report = check_model(GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2)), tokenizer=tok)
    assert [r.name for r in report.failed] == ["architecture"] and "rotary" in report.row("architecture").message
    assert "FAILED: architecture" in report.table()


# -- the cached verdict ------------------------------------------------------------------------
def test_gate_caches_its_verdict_and_reads_it_back(home, monkeypatch):
    lm = lm_of("qwen3")
    first = gate(lm)
    assert first.passed and not first.cached
    path = verdict_path(lm.fingerprint)
    assert path == home / "checks" / f"{lm.fingerprint}.json"
    data = json.loads(path.read_text())
    assert data["fingerprint"] == lm.fingerprint and data["versions"]["check"] == verdicts.CHECK_VERSION
    assert data["verdicts"]["cpu"]["report"]["rows"][5]["name"] == "re-rotated keys"

    def boom(lm):
        raise AssertionError("the checks ran again instead of reading the cached verdict")

    monkeypatch.setattr(verdicts, "run_checks", boom)
    second = gate(lm)
    assert second.cached and second.passed and second.fingerprint == lm.fingerprint
    assert "cached verdict" in second.table()
    # it really is the file that decides: a verdict edited to a failure is obeyed
    data["verdicts"]["cpu"]["report"]["rows"][6]["passed"] = False
    data["verdicts"]["cpu"]["report"]["rows"][6]["message"] = "edited"
    path.write_text(json.dumps(data))
    with pytest.raises(UnsupportedModelError, match="failed check reuse = full \\(1 chunk\\): edited"):
        gate(lm)


def test_gate_reruns_when_the_verdict_does_not_apply(monkeypatch):
    lm = lm_of("llama")
    gate(lm)
    path = verdict_path(lm.fingerprint)
    runs = []
    real = check.run_checks
    monkeypatch.setattr(verdicts, "run_checks", lambda lm: runs.append(1) or real(lm))
    data = json.loads(path.read_text())
    data["versions"]["transformers"] = "0.0"  # another transformers: model code may differ
    path.write_text(json.dumps(data))
    gate(lm)
    assert len(runs) == 1
    gate(lm)  # rewritten, so read back now
    assert len(runs) == 1
    gate(lm, refresh=True)
    assert len(runs) == 2
    path.write_text("{not json")  # a damaged file is a miss, never an error
    gate(lm)
    assert len(runs) == 3


def test_a_failing_verdict_is_cached_too():
    lm = from_model(tiny_other("mistral", sliding_window=64), tiny_tokenizer())
    with pytest.raises(UnsupportedModelError):
        gate(lm)
    assert json.loads(verdict_path(lm.fingerprint).read_text())["verdicts"]["cpu"]["report"]["rows"][3]["passed"] is False
    with pytest.raises(UnsupportedModelError, match="sliding window"):
        gate(lm)


def test_engine_runs_the_gate_once_per_fingerprint(home):
    lm = lm_of("mistral")
    rag = KVRag(lm, store="memory://")
    assert rag.check_report.passed and not rag.check_report.cached
    assert verdict_path(lm.fingerprint).exists()
    again = KVRag(lm, store="memory://")
    assert again.check_report.cached
    other = lm_of("mistral", seed=3)
    skipped = KVRag(other, store="memory://", check=False)
    assert skipped.check_report is None and not verdict_path(other.fingerprint).exists()


# -- the command -------------------------------------------------------------------------------
def cli(argv):
    parser = argparse.ArgumentParser(prog="kvrag")
    add_check_model_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def saved(model, path):
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return str(path)


def test_check_model_command_prints_the_table_and_caches_the_verdict(tmp_path, capsys):
    folder = saved(tiny_model("qwen2"), tmp_path / "qwen2")
    assert cli(["check-model", folder, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "re-rotated keys" in out and "PASSED" in out and "Qwen2ForCausalLM" in out
    assert len(list((tmp_path / "home" / "checks").glob("*.json"))) == 1  # the engine will reuse it
    assert cli(["check-model", folder, "--device", "cpu", "--dtype", "bfloat16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["dtype"] == "bfloat16" and report["device"] == "cpu"


def test_check_model_command_fails_with_the_failing_check_named(tmp_path, capsys):
    folder = saved(tiny_other("mistral", sliding_window=64), tmp_path / "sw")
    assert cli(["check-model", folder]) == 1
    captured = capsys.readouterr()
    assert "FAIL" in captured.out and "FAILED: sliding window" in captured.out
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("kvrag: error: kvrag cannot serve") and "failed check sliding window" in last


def test_check_model_command_checks_a_shape_with_random_weights(tmp_path, capsys, monkeypatch):
    """`--shape NAME` (kvrag/shapes) builds that shape with random weights: the gate at 1B-8B scale
    with nothing downloaded. Here a tiny config stands in for a shape file."""
    import kvrag.model.shapes as speed

    tiny_cfg = tiny_model("qwen2").config
    real = speed.shape_config
    monkeypatch.setattr(speed, "shape_config", lambda name: tiny_cfg if name == "tiny-qwen2" else real(name))
    folder = saved(tiny_model("llama"), tmp_path / "tok")  # only its tokenizer is used
    assert cli(["check-model", folder, "--shape", "tiny-qwen2", "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["source"] == "random:tiny-qwen2"
    with pytest.raises(ValueError, match="unknown shape"):
        cli(["check-model", "--shape", "gpt-9"])


def test_check_model_command_on_a_model_without_rope(tmp_path, capsys):
    tok = tiny_tokenizer()
    folder = saved(GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2)), tmp_path / "gpt2")
    assert cli(["check-model", folder]) == 1
    assert "FAILED: architecture" in capsys.readouterr().out


# -- device and dtype --------------------------------------------------------------------------
def test_auto_device_and_dtype_resolve_to_cpu_float32_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto").type == "cpu" and resolve_dtype("auto", "auto") == torch.float32
    folder = saved(tiny_model("llama"), tmp_path / "llama")
    rag = KVRag.from_pretrained(folder, store="memory://")  # device="auto", dtype="auto" by default
    assert rag.lm.device.type == "cpu" and rag.lm.dtype == torch.float32
    assert rag.check_report.passed and rag.check_report.device == "cpu"


def test_auto_dtype_on_cuda_is_bfloat16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_device("auto").type == "cuda" and resolve_dtype("auto", "auto") == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # e.g. a V100 / T4
    assert resolve_dtype("auto", "cuda") == torch.float16
    assert resolve_dtype("float32", "cuda") == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("float8")


def test_bfloat16_engine_end_to_end_and_entries_keep_their_dtype(tmp_path):
    folder = saved(tiny_model("llama"), tmp_path / "llama")
    store = f"disk://{tmp_path}/kv"
    rag = KVRag.from_pretrained(folder, store=store, device="cpu", dtype="bfloat16")
    assert rag.lm.dtype == torch.bfloat16 and rag.check_report.dtype == "bfloat16"
    chunks = list(CHECK_CHUNKS)
    rag.precompute(chunks, progress=False)
    a = chunks[0].id
    full = rag.prefill(CHECK_QUESTION, [a], method="full")
    reuse = rag.prefill(CHECK_QUESTION, [a], method="reuse")
    rel = lambda x, y: float((x - y).norm() / y.norm())  # noqa: E731
    assert rel(reuse.logits, full.logits) <= TOLERANCES[torch.bfloat16]["logits"]
    every = rag.prefill(CHECK_QUESTION, [c.id for c in chunks], method="epic", recompute_ratio=1.0)
    full2 = rag.prefill(CHECK_QUESTION, [c.id for c in chunks], method="full")
    assert rel(every.logits, full2.logits) <= TOLERANCES[torch.bfloat16]["logits"]
    # bf16 is close to fp32 Full Attention, within bf16's own precision
    ref = KVRag.from_pretrained(folder, store="memory://", device="cpu", dtype="float32")
    assert rel(full.logits, ref.prefill(CHECK_QUESTION, chunks=[chunks[0]], method="full").logits) <= 5e-2
    out = rag.answer(CHECK_QUESTION, [a], max_new_tokens=4)
    assert out.stats.cache_hits == 1 and out.stats.generated_tokens > 0

    # the stored entry's header keeps its dtype ...
    ids = rag.layout.chunk_ids(chunks[0])
    key = rag._key(KIND_CHUNK, ids)
    entry = rag.store.get(key)
    assert entry.keys.dtype == torch.bfloat16 and entry.values.dtype == torch.bfloat16
    # ... and entries of another dtype under our keys are cast to the engine's dtype on load
    pkey = rag._key(KIND_PREFIX, rag.layout.prefix_ids)
    for k in (key, pkey):
        e = rag.store.get(k)
        rag.store.put(k, KVEntry(e.keys.float(), e.values.float(), meta=e.meta, token_ids=e.token_ids))
    assert rag.store.get(key).keys.dtype == torch.float32
    fresh = KVRag(rag.lm, store=store)
    again = fresh.prefill(CHECK_QUESTION, [a], method="reuse")
    assert again.stats.cache_hits == 1 and fresh.prefix_kv()[0].dtype == torch.bfloat16
    assert torch.equal(again.logits, reuse.logits)  # bf16 -> fp32 -> bf16 is lossless


# -- the bundled model -------------------------------------------------------------------------
@pytest.mark.smollm
def test_check_passes_on_the_bundled_model(smollm):
    report = check_model(smollm)
    assert report.passed, report.table()
    assert report.source == "bundled:smollm2-135m-instruct" and report.dtype == "float32"
    assert report.row("architecture").message.startswith("LlamaForCausalLM, 30 layers")
    for name in NUMERIC:
        assert report.row(name).error <= report.row(name).tolerance == 1e-4
    assert isinstance(CheckReport.from_dict(json.loads(json.dumps(report.to_dict()))), CheckReport)


def test_load_tokenizer_reads_a_folder_without_weights(tmp_path):
    """Random-weight shapes need only a tokenizer: `load_tokenizer` reads one from a folder (a GPU
    machine carries 2 MB, not the GGUF) and says clearly when the path holds none."""
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    tok = kmodel.load_tokenizer(tmp_path / "tok")
    assert tok.decode(tok("kv cache reuse")["input_ids"]) == "kv cache reuse"
    with pytest.raises(kmodel.ModelLoadError):
        kmodel.load_tokenizer(tmp_path / "missing.gguf")
    with pytest.raises(kmodel.ModelLoadError):
        kmodel.load_tokenizer(tmp_path / "empty-folder-that-is-not-there")
