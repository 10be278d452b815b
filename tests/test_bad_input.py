"""Bad input gets a clear error naming the fix, and the CLI prints no traceback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lithos.checkpoint import load_checkpoint
from lithos.errors import CheckpointError, LithosError, UnsupportedModelError

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "lithos.cli", *args], capture_output=True, text=True, env=env, timeout=600
    )


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_missing_path():
    with pytest.raises(CheckpointError, match="does not exist: pass a Hugging Face model directory"):
        load_checkpoint("/no/such/model")


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        load_checkpoint(tmp_path)


def test_truncated_safetensors(hf_checkpoint, tmp_path):
    path = copy_checkpoint(hf_checkpoint("qwen2"), tmp_path / "m")
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt.*re-download"):
        load_checkpoint(path)


def test_garbage_safetensors(hf_checkpoint, tmp_path):
    path = copy_checkpoint(hf_checkpoint("qwen2"), tmp_path / "m")
    (path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(path)


def test_sharded_safetensors_with_missing_shard(hf_checkpoint, tmp_path):
    path = copy_checkpoint(hf_checkpoint("qwen2"), tmp_path / "m")
    index = {
        "weight_map": {
            "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
        }
    }
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing shards"):
        load_checkpoint(path)


def test_unsupported_architecture(hf_checkpoint, tmp_path):
    path = copy_checkpoint(hf_checkpoint("qwen2"), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="'GPT2LMHeadModel' is not supported; supported: "):
        load_checkpoint(path)


def test_config_and_weights_disagree(hf_checkpoint, tmp_path):
    path = copy_checkpoint(hf_checkpoint("qwen2"), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 128
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="config and weights disagree"):
        load_checkpoint(path, use_cache=False)


def test_truncated_gguf(smollm2_gguf, tmp_path):
    bad = tmp_path / "truncated.gguf"
    with open(smollm2_gguf, "rb") as f:
        bad.write_bytes(f.read(5_000_000))
    with pytest.raises(CheckpointError, match="truncated or corrupt: re-download"):
        load_checkpoint(bad)


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_checkpoint(bad)


def test_unknown_role(hf_checkpoint):
    import lithos

    model = lithos.load(hf_checkpoint("qwen2"), dtype="float32", max_len=64)
    with pytest.raises(LithosError, match="system, user, assistant, tool"):
        model.generate([{"role": "narrator", "content": "hi"}])


@pytest.mark.parametrize(
    "args,message",
    [
        (["generate", "hi", "--model", "/no/such/model"], "does not exist"),
        (["generate", "hi", "--model", "{empty}"], "has no config.json"),
        (["generate", "x" * 100, "--raw", "--model", "{tiny}", "--max-len", "32"], "the cache holds 32"),
        (["generate", "hi", "--model", "{tiny}", "--kernels", "warp9"], "kernel path 'warp9'"),
    ],
)
def test_cli_errors_have_no_traceback(args, message, hf_checkpoint, tmp_path):
    fill = {"empty": str(tmp_path), "tiny": str(hf_checkpoint("qwen2"))}
    proc = run_cli(*[a.format(**fill) for a in args])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert message in proc.stderr
