"""The lent-GPU chain (scripts/gpu/, issue #55) on this CPU: KVRAG_GPU_DRY=1 runs its steps with tiny
settings, so the parcels, the distillation's pieces and the files each call returns are checked
without a GPU. The first call's dry run loads the bundled model four times (~3 min on 2 cores): it
runs only with KVRAG_TEST_GPU_CHAIN=1."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import qa_rows, tiny_model, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
DEVICE = REPO / "scripts" / "gpu" / "device.sh"
PREPARE = REPO / "scripts" / "gpu" / "prepare.sh"
FILES_BACK = 8  # the most files one call returns


def sh(script, *args, cwd, env, check=True):
    res = subprocess.run(["bash", str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    if check and res.returncode:
        raise AssertionError(f"{script.name} {' '.join(args)}: rc {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
    return res


def dry_env(tmp_path, **kw):
    return {**os.environ, "KVRAG_GPU_DRY": "1", "PYTHON": sys.executable, "TQDM_DISABLE": "1", **{k: str(v) for k, v in kw.items()}}


def test_the_scripts_parse():
    for script in (DEVICE, PREPARE):
        subprocess.run(["bash", "-n", str(script)], check=True)
    if shutil.which("shellcheck"):
        subprocess.run(["shellcheck", str(DEVICE), str(PREPARE)], check=True)


def piece(stage, work, out, env, parts):
    """One lending's distill calls: each parcel stashed on a fresh machine, then a piece of training."""
    env = {**env, "KVRAG_GPU_WORK": str(work), "OUT": str(out)}
    for n in range(1, parts + 1):
        sh(DEVICE, "stash", str(n), cwd=stage, env=env)
    sh(DEVICE, "distill", "1", cwd=stage, env=env)
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= FILES_BACK and {"adapter.safetensors", "train_summary.json", "distill-train.log", "state.tar.00"} <= set(files)
    return json.loads((out / "train_summary.json").read_text())


def test_the_distillation_travels_in_parcels_and_resumes_on_a_fresh_machine(tmp_path):
    model = tmp_path / "tiny-model"
    tiny_model("llama", seed=0, layers=2).save_pretrained(model)
    tiny_tokenizer().save_pretrained(model)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in qa_rows(6)))
    stage, state = tmp_path / "stage", tmp_path / "state"
    env = dry_env(tmp_path, KVRAG_GPU_STAGE=stage, DISTILL_DATA=f"{rows}@0:6", DISTILL_STATE=state, DISTILL_MODEL=model,
                  KVRAG_GPU_PART_BYTES=150_000)

    sh(PREPARE, "--distill", cwd=REPO, env=env)
    parts = len(list(stage.glob(".gp[0-9]*")))
    assert parts >= 2 and "state: none" in (stage / ".gp1" / "manifest").read_text()
    # a machine that lacks a parcel refuses to train
    lacking = sh(DEVICE, "distill", "1", cwd=stage, env={**env, "KVRAG_GPU_WORK": str(tmp_path / "w0"), "OUT": str(tmp_path / "o0")},
                 check=False)
    assert lacking.returncode != 0 and "stash parcel 1" in lacking.stdout

    first = piece(stage, tmp_path / "w1", tmp_path / "o1", env, parts)
    assert first["steps"] == 1 and first["stopped_early"]
    state.mkdir()
    for f in (tmp_path / "o1").glob("state.tar.*"):  # what a session copies back from the call's files
        shutil.copy(f, state)

    sh(PREPARE, "--distill", cwd=REPO, env=env)  # the next lending: the state rides in the parcels
    assert "resumed from" in (stage / ".gp1" / "manifest").read_text()
    parts = len(list(stage.glob(".gp[0-9]*")))
    second = piece(stage, tmp_path / "w2", tmp_path / "o2", env, parts)
    assert second["steps"] == 2 and second["losses"][0] == first["losses"][0]
    assert second["examples_seen"] == 2


CALLS = {  # each call of a lending: the files it promises ($OUT) and the steps its chain.log reports
    "first": ({"chain.log", "cuda-tests.log", "prefill-profile.txt", "store-tiers.md", "speed-tiers.md", "speed-tiers.json"},
              ("tests", "prefill", "store", "tiers")),
    "second": ({"chain.log", "decode-8b.md", "decode-8b.json", "serve.log", "server_bench.md", "server_bench.json", "decode-profile.txt"},
               ("decode", "serve", "profile")),
}


@pytest.mark.skipif(os.environ.get("KVRAG_TEST_GPU_CHAIN") != "1", reason="minutes on 2 cores: set KVRAG_TEST_GPU_CHAIN=1")
@pytest.mark.parametrize("call", sorted(CALLS))
def test_each_call_writes_every_file_it_promises(tmp_path, call):
    out = tmp_path / "out"
    sh(DEVICE, call, cwd=tmp_path, env=dry_env(tmp_path, KVRAG_GPU_WORK=tmp_path / "w", OUT=out, FIRST_BUDGET_S=900, SECOND_BUDGET_S=900))
    expected, steps = CALLS[call]
    assert {p.name for p in out.iterdir()} == expected and len(expected) <= FILES_BACK
    log = (out / "chain.log").read_text()
    assert "commit:" in log and all(f"{step}: rc 0" in log for step in steps), log
