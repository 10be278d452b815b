"""Task files: headers, template files, prompts; and bad input with errors naming file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lithos.errors import LithosError
from lithos.eval import load_task

DATA = Path(__file__).parent / "data"


def write(path: Path, *lines) -> Path:
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def test_math_task_with_header():
    task = load_task(DATA / "arith.jsonl")
    assert (task.name, task.kind, len(task)) == ("arith", "math", 4)
    assert [it.id for it in task.items] == ["add-small", "sub", "add", "mul-big"]
    first = task.items[0]
    assert task.prompt(first) == [{"role": "user", "content": "What is 2 + 3?\nAnswer with a number only."}]
    assert [task.expected(it) for it in task.items] == ["5", "6", "15", "7006652"]
    assert task.score(first, "2 + 3 = 5").correct
    assert task.template.max_new_tokens == 24


def test_plain_gsm8k_file_with_a_fewshot_template_file():
    """A GSM8K file as downloaded (no header): the kind is inferred, the template comes from a file."""
    task = load_task(DATA / "gsm8k_sample.jsonl", template=DATA / "gsm8k-fewshot.json", num_fewshot=2)
    assert (task.name, task.kind, task.template.format) == ("gsm8k", "math", "raw")
    assert [it.id for it in task.items] == ["1", "2"]  # line numbers
    prompt = task.prompt(task.items[1])
    assert prompt.startswith("Question: There are 15 trees")
    assert " 3 + 2 = 5.\n#### 5\n\nQuestion: Weng earns $12" in prompt
    assert prompt.endswith("How much did she earn?\nAnswer:")
    assert "Leah" not in prompt  # num_fewshot=2
    # The reply is cut at the stop string before scoring: the model's next made-up question is ignored.
    assert task.score(task.items[1], " She earned 0.2 x 50 = 10.\n#### 10\n\nQuestion: 99 apples?").correct
    assert task.expected(task.items[0]) == "72"


def test_chat_fewshot_becomes_earlier_turns(tmp_path):
    path = write(
        tmp_path / "t.jsonl",
        {
            "task": {
                "kind": "math",
                "system": "Be brief.",
                "prompt": "Q: {question}",
                "fewshot": [{"question": "1 + 1?", "answer": "#### 2"}],
            }
        },
        {"question": "2 + 2?", "answer": "#### 4"},
    )
    task = load_task(path)
    assert task.prompt(task.items[0]) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Q: 1 + 1?"},
        {"role": "assistant", "content": "#### 2"},
        {"role": "user", "content": "Q: 2 + 2?"},
    ]


def test_choice_and_exact_tasks():
    planets = load_task(DATA / "planets.jsonl")
    largest, red = planets.items
    text = planets.prompt(largest)[0]["content"]
    assert "A. Mars\nB. Jupiter\nC. Venus\nD. Mercury" in text
    assert [planets.expected(it) for it in planets.items] == ["B", "C"]
    assert planets.score(red, "The answer is C.").correct
    assert not planets.score(red, "A").correct

    capitals = load_task(DATA / "capitals.jsonl")
    fr, it = capitals.items
    assert capitals.prompt(fr)[0]["content"] == "What is the capital of France? Answer with the city name only."
    assert capitals.score(fr, "The capital of France is Paris.").correct  # match: contains
    assert capitals.score(it, "Roma").correct


def test_template_braces_other_than_fields_are_kept(tmp_path):
    path = write(
        tmp_path / "t.jsonl",
        {"task": {"kind": "exact", "prompt": 'Reply as JSON {"city": ...}: {question}'}},
        {"question": "Capital of Peru?", "answer": "Lima"},
    )
    task = load_task(path)
    assert task.prompt(task.items[0])[0]["content"] == 'Reply as JSON {"city": ...}: Capital of Peru?'


def test_overrides_beat_the_header(tmp_path):
    task = load_task(DATA / "arith.jsonl", format="raw", max_new_tokens=8)
    assert task.template.format == "raw" and task.template.max_new_tokens == 8
    assert task.prompt(task.items[0]) == "What is 2 + 3?\nAnswer with a number only."


# ---- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lines, message",
    [
        ([], r"t\.jsonl is empty"),
        (["", "   "], r"t\.jsonl is empty"),
        ([{"task": {"kind": "math"}}], r"has a header but no items"),
        ([{"question": "1+1?", "answer": "#### 2"}, '{"question": "2+2?", "answer": '], r"t\.jsonl:2: not valid JSON"),
        ([{"question": "1+1?", "answer": "#### 2"}, "[1, 2]"], r"t\.jsonl:2: expected a JSON object, got list"),
        ([{"task": {"kind": "math"}}, {"question": "1+1?"}], r"t\.jsonl:2: missing field 'answer'"),
        ([{"task": {"kind": "math"}}, {"answer": "#### 2"}], r"t\.jsonl:2: missing field 'question'"),
        ([{"task": {"kind": "math"}}, {"question": "q", "answer": "two"}], r"t\.jsonl:2: answer 'two' neither ends"),
        (
            [{"task": {"kind": "math"}}, {"question": "q", "answer": "#### 2 apples"}],
            r"t\.jsonl:2: the text after '####'",
        ),
        (
            [{"task": {"kind": "choice"}}, {"question": "q", "choices": ["x", "y"], "answer": "C"}],
            r"t\.jsonl:2: answer 'C' is not one of the letters A, B",
        ),
        ([{"task": {"kind": "choice"}}, {"question": "q", "choices": [], "answer": 0}], r"t\.jsonl:2: choices must be"),
        ([{"task": {"kind": "exact"}}, {"question": "q", "answer": ""}], r"t\.jsonl:2: answer is empty"),
        ([{"task": {"kind": "sums"}}, {"question": "q", "answer": 1}], r"t\.jsonl:1: kind 'sums' is not one of"),
        (
            [{"task": {"kind": "math", "promt": "x"}}, {"question": "q", "answer": 1}],
            r"t\.jsonl:1: unknown task setting 'promt'",
        ),
        (
            [{"task": {"kind": "math", "max_new_tokens": "many"}}, {"question": "q", "answer": 1}],
            r"t\.jsonl:1: task setting 'max_new_tokens' has the wrong type",
        ),
        (
            [{"task": {"kind": "exact", "prompt": "{question} {context}"}}, {"question": "q", "answer": "a"}],
            r"t\.jsonl:2: missing field 'context'",
        ),
        ([{"question": "q", "answer": "a"}], r"no task kind: add a header line"),
        (
            [
                {"task": {"kind": "exact"}},
                {"id": 1, "question": "q", "answer": "a"},
                {"id": 1, "question": "r", "answer": "b"},
            ],
            r"t\.jsonl:3: id '1' is used again \(first on line 2\)",
        ),
        (
            [{"task": {"kind": "exact"}}, {"question": "q", "answer": "a"}, {"task": {"kind": "math"}}],
            r"t\.jsonl:3: a header line may only be the first line",
        ),
        (
            [{"task": {"kind": "math", "fewshot": [{"question": "q"}]}}, {"question": "q", "answer": 1}],
            r"few-shot example 1: missing field 'answer'",
        ),
    ],
)
def test_bad_task_files(tmp_path, lines, message):
    path = write(tmp_path / "t.jsonl", *lines)
    with pytest.raises(LithosError, match=message):
        load_task(path)


def test_missing_and_non_utf8_files(tmp_path):
    with pytest.raises(LithosError, match=r"task file .*nope\.jsonl does not exist"):
        load_task(tmp_path / "nope.jsonl")
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "caf\xe9", "answer": "#### 1"}\n')
    with pytest.raises(LithosError, match=r"latin1\.jsonl is not UTF-8"):
        load_task(path)


def test_bad_template_files(tmp_path):
    with pytest.raises(LithosError, match=r"template file .* does not exist"):
        load_task(DATA / "arith.jsonl", template=tmp_path / "none.json")
    broken = tmp_path / "broken.json"
    broken.write_text('{"kind": "math",\n "prompt": }')
    with pytest.raises(LithosError, match=r"broken\.json:2: not valid JSON"):
        load_task(DATA / "arith.jsonl", template=broken)
    too_many = tmp_path / "many.json"
    too_many.write_text(json.dumps({"num_fewshot": 9}))
    with pytest.raises(LithosError, match="num_fewshot is 9 but the template has 0 examples"):
        load_task(DATA / "arith.jsonl", template=too_many)
