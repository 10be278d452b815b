"""`lithos eval` on the real default model: a batch run with a known result, and greedy
speculative decoding that differs from plain decoding nowhere."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lithos.eval import compare, evaluate, load_task

DATA = Path(__file__).parent / "data"
SPEC = {"spec": "ngram", "draft_tokens": 3}


@pytest.fixture(scope="module")
def task():
    return load_task(DATA / "arith.jsonl")


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("eval")


@pytest.fixture(scope="module")
def plain_run(smollm2_model, task, out):
    return evaluate(smollm2_model, task, batch_size=2, out=out, progress=False)


def test_batch_run_has_the_known_result(plain_run):
    """SmolLM2-135M adds small numbers and fails the rest: greedy, so always the same two of four."""
    records = plain_run.records
    assert [r["output"] for r in records] == ["2 + 3 = 5", "10 - 4 = 4", "7 + 8 = 15", "1234 * 5678 = 7321088"]
    assert [r["extracted"] for r in records] == ["5", "4", "15", "7321088"]
    assert [r["correct"] for r in records] == [True, False, True, False]
    assert (plain_run.accuracy, plain_run.unparsed) == (0.5, 0)
    assert all(r["finish_reason"] == "stop" for r in records)
    assert plain_run.items_per_s > 0 and plain_run.tokens_per_s > 0
    summary = json.loads(plain_run.path.with_suffix(".json").read_text())
    assert summary["accuracy"] == 0.5 and summary["model"].endswith(".gguf")


def test_speculative_greedy_differs_nowhere(smollm2_model, task, out, plain_run):
    comparison = compare(smollm2_model, task, {}, SPEC, batch_size=2, out=out, progress=False)
    assert comparison.a.records == plain_run.records  # resumed from the plain run's file
    assert comparison.differences == []
    assert comparison.b.accuracy == 0.5
    assert comparison.b.tokens_per_round >= 1.0
    assert "outputs identical on all 4 items" in comparison.table()


def test_compare_finds_a_difference_planted_in_the_results(smollm2_model, task, out, tmp_path, plain_run):
    """Edit one finished record of the speculative run: resuming both runs reports exactly that item."""
    planted = tmp_path / "planted"
    shutil.copytree(out, planted)
    (spec_file,) = planted.glob("arith.draft_tokens=3,spec=ngram.jsonl")
    lines = [json.loads(line) for line in spec_file.read_text().splitlines()]
    for record in lines[1:]:
        if record["id"] == "sub":
            record["token_ids"] = record["token_ids"][:4] + [smollm2_model.tokenizer.encode(" 6")[0]]
            record["output"] = smollm2_model.tokenizer.decode(record["token_ids"])
    spec_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    comparison = compare(smollm2_model, task, {}, SPEC, batch_size=2, out=planted, progress=False)
    (diff,) = comparison.differences
    assert (diff.id, diff.first_token) == ("sub", 4)
    assert "outputs differ on 1 of 4 items" in comparison.table()
