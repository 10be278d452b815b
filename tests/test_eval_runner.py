"""The eval runner with a stand-in model (no JAX): batching, results files, resuming after an
interruption, comparison of two configurations, and the `lithos eval` command."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import lithos
from lithos.engine import GenerationResult
from lithos.errors import LithosError
from lithos.eval import RunConfig, compare, diff_runs, evaluate, load_task
from lithos.eval.runner import first_difference

DATA = Path(__file__).parent / "data"

# What the stand-in model answers to each arith.jsonl question: two right, two wrong.
REPLIES = {
    "What is 2 + 3?": "2 + 3 = 5",
    "What is 10 - 4?": "10 - 4 = 4",
    "What is 7 + 8?": "7 + 8 = 15",
    "What is 1234 times 5678?": "1234 * 5678 = 7321088",
}


class FakeModel:
    """Stands in for lithos.Model: replies from REPLIES (with sampling, a different reply to the
    subtraction), records each generate_batch call, and can be interrupted on a given call."""

    def __init__(self, interrupt_on_call: int | None = None):
        self.checkpoint = SimpleNamespace(source="fake.gguf", dtype="float32")
        self.cfg = SimpleNamespace(
            architecture="LlamaForCausalLM", qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, head_dim=64
        )
        self.kernels = "reference"
        self.calls: list[dict] = []
        self.interrupt_on_call = interrupt_on_call

    def prompt_ids(self, prompt, raw=False):
        text = prompt if raw else prompt[-1]["content"]
        return list(range(len(text.split())))

    def generate_batch(
        self, prompts, max_new_tokens=256, raw=False, temperature=0.0, seed=0, spec=None, draft_tokens=5
    ):
        self.calls.append(dict(n=len(prompts), seed=seed, temperature=temperature, kernels=self.kernels))
        if len(self.calls) == self.interrupt_on_call:
            raise KeyboardInterrupt
        results = []
        for prompt in prompts:
            question = prompt[-1]["content"].split("\n")[0]
            text = REPLIES[question]
            if temperature > 0 and question == "What is 10 - 4?":
                text = "10 - 4 = 6"
            ids = [ord(c) for c in text][:max_new_tokens]
            result = GenerationResult(text, ids, len(prompt), "stop", prefill_ms=1.0, decode_ms=2.0)
            if spec is not None:  # as if every round accepted one draft
                result.spec = SimpleNamespace(
                    drafter=spec, draft_tokens=draft_tokens, rounds=len(ids) // 2, accepted=len(ids) // 2
                )
            results.append(result)
        return results


@pytest.fixture
def task():
    return load_task(DATA / "arith.jsonl")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_run_scores_batches_and_writes_results(task, tmp_path):
    model = FakeModel()
    run = evaluate(model, task, batch_size=2, out=tmp_path, progress=False)
    assert [r["id"] for r in run.records] == ["add-small", "sub", "add", "mul-big"]  # task order
    assert [r["correct"] for r in run.records] == [True, False, True, False]
    assert [r["extracted"] for r in run.records] == ["5", "4", "15", "7321088"]
    assert (run.correct, run.accuracy, run.unparsed) == (2, 0.5, 0)
    assert [c["n"] for c in model.calls] == [2, 2]
    assert [c["seed"] for c in model.calls] == [0, 1]  # batch b is seeded with seed + b
    assert run.path == tmp_path / "arith.default.jsonl"
    lines = read_jsonl(run.path)
    assert lines[0]["lithos_eval"]["model"] == "fake.gguf" and len(lines) == 5
    summary = json.loads(run.path.with_suffix(".json").read_text())
    assert summary["accuracy"] == 0.5 and summary["items"] == 4 and summary["items_per_s"] > 0
    table = run.table()
    assert "arith" in table and "0.500" in table


def test_interrupted_run_keeps_finished_batches_and_resumes(task, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        evaluate(FakeModel(interrupt_on_call=2), task, batch_size=2, out=tmp_path, progress=False)
    path = tmp_path / "arith.default.jsonl"
    assert len(read_jsonl(path)) == 1 + 2  # header + the first batch

    model = FakeModel()
    run = evaluate(model, task, batch_size=2, out=tmp_path, progress=False)
    assert model.calls == [dict(n=2, seed=1, temperature=0.0, kernels="reference")]  # only the second batch
    assert run.correct == 2 and len(read_jsonl(path)) == 1 + 4

    model = FakeModel()
    again = evaluate(model, task, batch_size=2, out=tmp_path, progress=False)
    assert model.calls == [] and again.records == run.records


def test_resume_drops_a_partly_written_last_line(task, tmp_path):
    evaluate(FakeModel(), task, batch_size=2, out=tmp_path, progress=False)
    path = tmp_path / "arith.default.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:-1]) + lines[-1][:25])  # killed in the middle of a write
    model = FakeModel()
    run = evaluate(model, task, batch_size=2, out=tmp_path, progress=False)
    assert [c["n"] for c in model.calls] == [1]  # the item whose record was cut is redone
    assert run.correct == 2 and len(read_jsonl(path)) == 5


def test_results_of_another_run_are_not_reused(task, tmp_path):
    evaluate(FakeModel(), task, batch_size=2, out=tmp_path, progress=False)
    with pytest.raises(
        LithosError, match=r"holds results of another run \(max_new_tokens: 24 there, 8 now\).*--restart"
    ):
        evaluate(FakeModel(), task, batch_size=2, max_new_tokens=8, out=tmp_path, progress=False)
    model = FakeModel()
    evaluate(model, task, batch_size=2, max_new_tokens=8, out=tmp_path, restart=True, progress=False)
    assert len(model.calls) == 2

    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "arith.default.jsonl").write_text("hello\n")
    with pytest.raises(LithosError, match=r"arith\.default\.jsonl:1: not a lithos eval results file"):
        evaluate(FakeModel(), task, batch_size=2, out=garbage, progress=False)


def test_an_edited_item_is_redone(tmp_path):
    source = (DATA / "arith.jsonl").read_text()
    path = tmp_path / "arith.jsonl"
    path.write_text(source)
    evaluate(FakeModel(), load_task(path), batch_size=2, out=tmp_path / "out", progress=False)
    path.write_text(source.replace('"answer": 15', '"answer": 16'))
    model = FakeModel()
    run = evaluate(model, load_task(path), batch_size=2, out=tmp_path / "out", progress=False)
    assert [c["n"] for c in model.calls] == [1]
    assert run.correct == 1


def test_compare_finds_a_planted_difference(task, tmp_path):
    """Sampling makes the stand-in answer one item differently: exactly that item is reported."""
    comparison = compare(FakeModel(), task, {}, {"temperature": 0.7}, batch_size=2, out=tmp_path)
    (diff,) = comparison.differences
    assert (diff.id, diff.first_token, diff.a_correct, diff.b_correct) == ("sub", 9, False, True)
    summary = comparison.summary()
    assert summary["differ"] == 1 and summary["a_wrong_b_right"] == 1
    table = comparison.table()
    assert "outputs differ on 1 of 4 items" in table and '"10 - 4 = 6"' in table
    written = json.loads((tmp_path / "arith.compare.default.vs.temperature=0.7.json").read_text())
    assert written["differ"] == 1 and written["differences"][0]["id"] == "sub"


def test_compare_reports_nothing_between_identical_configurations(task):
    model = FakeModel()
    comparison = compare(model, task, RunConfig({}, name="a"), RunConfig({}, name="b"), batch_size=4, progress=False)
    assert comparison.differences == [] and len(model.calls) == 2
    assert "outputs identical on all 4 items" in comparison.table()
    with pytest.raises(LithosError, match="both configurations are named 'default'"):
        compare(model, task, {}, {}, progress=False)


def test_model_options_are_set_for_the_run_and_restored(task):
    model = FakeModel()
    evaluate(model, task, {"kernels": "fused"}, batch_size=4, progress=False)
    assert model.calls[0]["kernels"] == "fused" and model.kernels == "reference"
    with pytest.raises(LithosError, match="kernel path 'warp' is not available"):
        evaluate(model, task, {"kernels": "warp"}, progress=False)


def test_unknown_generate_option_is_a_clear_error(task):
    with pytest.raises(LithosError, match=r"generate does not take the option 'temprature' \(config temprature=0.5\)"):
        evaluate(FakeModel(), task, {"temprature": 0.5}, progress=False)


def test_first_difference_and_diff_runs(task):
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    a = evaluate(FakeModel(), task, progress=False)
    b = evaluate(FakeModel(), task, progress=False)
    assert diff_runs(a, b) == []
    b.records[3] = dict(b.records[3], token_ids=b.records[3]["token_ids"][:-1] + [0])  # plant a difference
    (diff,) = diff_runs(a, b)
    assert diff.id == "mul-big" and diff.first_token == len(a.records[3]["token_ids"]) - 1


def test_progress_without_tqdm_prints_lines(task, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    evaluate(FakeModel(), task, batch_size=2)
    err = capsys.readouterr().err
    assert "arith [default]: 2/4 items" in err and "accuracy 0.500" in err


def test_cli(task, tmp_path, monkeypatch, capsys):
    from lithos.cli import main

    monkeypatch.setattr(lithos, "load", lambda *a, **k: FakeModel())
    out = str(tmp_path / "results")
    assert main(["eval", str(DATA / "arith.jsonl"), "--batch-size", "2", "--out", out, "--no-progress"]) == 0
    stdout = capsys.readouterr().out
    assert "kernels=reference" in stdout and "0.500" in stdout

    argv = ["eval", str(DATA / "arith.jsonl"), "--batch-size", "2", "--out", out, "--no-progress"]
    argv += ["--compare", "temperature=0.7"]  # A is resumed from the run above; B runs
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "outputs differ on 1 of 4 items" in stdout and "sub (line 3), from token 9" in stdout

    assert main(["eval", str(DATA / "arith.jsonl"), "--set", "temperature"]) == 2
    assert "is not KEY=VALUE" in capsys.readouterr().err
    assert main(["eval", str(DATA / "arith.jsonl"), "--compare", "kernels=reference"]) == 2
    assert "changes nothing" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "none.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_interrupt_says_how_to_resume(tmp_path, monkeypatch, capsys):
    from lithos.cli import main

    monkeypatch.setattr(lithos, "load", lambda *a, **k: FakeModel(interrupt_on_call=2))
    argv = ["eval", str(DATA / "arith.jsonl"), "--batch-size", "2", "--out", str(tmp_path), "--no-progress"]
    assert main(argv) == 130
    assert "run the same command to resume" in capsys.readouterr().err
    monkeypatch.setattr(lithos, "load", lambda *a, **k: FakeModel())
    assert main(argv) == 0


def test_speculative_runs_report_tokens_per_round(task):
    run = evaluate(FakeModel(), task, {"spec": "ngram", "draft_tokens": 4}, progress=False)
    assert run.tokens_per_round == 2.0 and run.acceptance_rate == 0.25
    assert run.summary()["spec_tokens_per_round"] == 2.0 and "2.00" in run.table()
    plain = evaluate(FakeModel(), task, progress=False)
    assert plain.tokens_per_round is None and plain.table().rstrip().endswith("-")


def test_max_new_tokens_can_be_a_run_option(task):
    run = evaluate(FakeModel(), task, {"max_new_tokens": 3}, progress=False)
    assert [len(r["token_ids"]) for r in run.records] == [3, 3, 3, 3]
    assert run.summary()["max_new_tokens"] == 3
    with pytest.raises(LithosError, match="'raw' is the task's prompt format"):
        evaluate(FakeModel(), task, {"raw": True}, progress=False)


def test_resume_after_a_last_line_without_newline(task, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        evaluate(FakeModel(interrupt_on_call=2), task, batch_size=2, out=tmp_path, progress=False)
    path = tmp_path / "arith.default.jsonl"
    path.write_text(path.read_text().rstrip("\n"))  # the record is whole, its newline was not written
    run = evaluate(FakeModel(), task, batch_size=2, out=tmp_path, progress=False)
    assert run.correct == 2 and len(read_jsonl(path)) == 5
