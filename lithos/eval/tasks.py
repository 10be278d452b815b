"""Task files: JSONL items plus a prompt template that is data, not code.

A task file has one JSON object per line. Its first line may be a header, `{"task": {...}}`,
with the settings below; a separate template file (JSON, the same settings) may add to or
override them, so a plain GSM8K file can be used as downloaded:

    {"task": {"name": "arith", "kind": "math", "format": "chat",
              "prompt": "{question}", "target": "{answer}",
              "fewshot": [{"question": "1 + 1?", "answer": "1 + 1 = 2\\n#### 2"}]}}
    {"id": "q1", "question": "What is 2 + 3?", "answer": "#### 5"}

Settings: `kind` (math | choice | exact), `name`, `format` (chat: few-shot examples become earlier
turns of the chat template; raw: plain text completion), `system`, `prompt` and `target`
(templates; `{field}` is replaced by the item's field, other braces are kept), `fewshot` (example
items), `num_fewshot` (use the first N), `separator` (raw format, between examples),
`stop` (strings that end the reply for scoring), `max_new_tokens`, `match` (exact kind: exact
or contains).

Item fields: math `question`, `answer` (ending in `#### <number>`, or a number); choice
`question`, `choices` (a list), `answer` (a letter or a 0-based index); exact `question`,
`answer` (a string or a list of accepted strings). An optional `id` names the item (default: its
line number). Templates may use any other field an item has. In templates of choice tasks,
`{choices}` is the lettered list ("A. ...") and `{letters}` is "A, B, C, D".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lithos.errors import LithosError
from lithos.eval import scoring

KINDS = ("math", "choice", "exact")
FORMATS = ("chat", "raw")

# Per kind: what a prompt says by default, what a few-shot answer looks like, how long a reply may be.
DEFAULTS: dict[str, dict[str, Any]] = {
    "math": dict(
        prompt="{question}\nSolve it step by step, then give the final answer as a number after '####'.",
        target="{answer}",
        max_new_tokens=256,
    ),
    "choice": dict(
        prompt="{question}\n{choices}\nAnswer with the letter of the correct choice.",
        target="{answer}",
        max_new_tokens=16,
    ),
    "exact": dict(prompt="{question}", target="{answer}", max_new_tokens=32),
}
ANSWER_FIELDS = {"math": ("answer",), "choice": ("choices", "answer"), "exact": ("answer",)}
SETTINGS = (
    "name",
    "kind",
    "format",
    "system",
    "prompt",
    "target",
    "fewshot",
    "num_fewshot",
    "separator",
    "stop",
    "max_new_tokens",
    "match",
)
_PLACEHOLDER = re.compile(r"\{(\w+)\}")

Prompt = str | list[dict[str, str]]


@dataclasses.dataclass(frozen=True)
class Item:
    """One question of a task: its id, where it came from, and its fields as written."""

    id: str
    line: int
    fields: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Template:
    """How an item becomes a prompt, and how its reply is read."""

    prompt: str
    target: str
    format: str = "chat"
    system: str | None = None
    fewshot: tuple[Mapping[str, Any], ...] = ()
    separator: str = "\n\n"
    stop: tuple[str, ...] = ()
    max_new_tokens: int = 256
    match: str = "exact"


@dataclasses.dataclass(frozen=True)
class Task:
    """A named list of items of one kind with the template that turns each into a prompt."""

    name: str
    kind: str
    path: Path
    items: tuple[Item, ...]
    template: Template

    def __len__(self) -> int:
        return len(self.items)

    def prompt(self, item: Item) -> Prompt:
        """The prompt for `item`: a message list (chat format) or a string (raw format)."""
        t = self.template
        if t.format == "chat":
            messages = [{"role": "system", "content": t.system}] if t.system else []
            for example in t.fewshot:
                messages.append({"role": "user", "content": render(t.prompt, self.kind, example)})
                messages.append({"role": "assistant", "content": render(t.target, self.kind, example)})
            messages.append({"role": "user", "content": render(t.prompt, self.kind, item.fields)})
            return messages
        shots = [render(t.prompt, self.kind, ex) + render(t.target, self.kind, ex) for ex in t.fewshot]
        text = t.separator.join([*shots, render(t.prompt, self.kind, item.fields)])
        return (t.system + t.separator + text) if t.system else text

    def reply(self, output: str) -> str:
        """The part of a model's output that is scored: up to the first stop string."""
        for stop in self.template.stop:
            cut = output.find(stop)
            if cut >= 0:
                output = output[:cut]
        return output

    def expected(self, item: Item) -> str:
        """The correct answer as the scorer reads it (a number, a letter, or the first accepted text)."""
        fields = item.fields
        if self.kind == "math":
            return scoring.format_number(scoring.reference_number(fields["answer"]))
        if self.kind == "choice":
            return scoring.reference_letter(fields["answer"], len(choice_list(fields["choices"])))
        return scoring.reference_texts(fields["answer"])[0]

    def score(self, item: Item, output: str) -> scoring.Score:
        reply = self.reply(output)
        fields = item.fields
        if self.kind == "math":
            return scoring.score_math(reply, fields["answer"])
        if self.kind == "choice":
            return scoring.score_choice(reply, choice_list(fields["choices"]), fields["answer"])
        return scoring.score_exact(reply, fields["answer"], self.template.match)

    def item_key(self, item: Item) -> str:
        """A hash of what decides an item's result (prompt and answer): a resumed run reuses a
        finished result only when its key still matches."""
        blob = json.dumps([self.prompt(item), self.expected(item), self.template.stop], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def choice_list(choices: Sequence[str] | Mapping[str, str]) -> list[str]:
    """Choices as a list in letter order; a {"A": ..., "B": ...} mapping is accepted too."""
    if isinstance(choices, Mapping):
        return [str(choices[k]) for k in sorted(choices)]
    return [str(c) for c in choices]


def template_fields(kind: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """The values templates see: the item's fields, with choices written out as lettered lines."""
    values = dict(fields)
    if kind == "choice" and "choices" in fields:
        choices = choice_list(fields["choices"])
        letters = scoring.choice_letters(len(choices))
        values["choices"] = "\n".join(f"{letter}. {text}" for letter, text in zip(letters, choices))
        values["letters"] = ", ".join(letters)
        if "answer" in fields:
            values["answer"] = scoring.reference_letter(fields["answer"], len(choices))
    return values


def render(template: str, kind: str, fields: Mapping[str, Any]) -> str:
    """Replace each `{field}` in `template` by the item's value (KeyError names a missing field)."""
    values = template_fields(kind, fields)
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)


def placeholders(template: str) -> set[str]:
    return set(_PLACEHOLDER.findall(template))


# ---- reading files ---------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for each non-blank line; errors name the file and the line."""
    if not path.is_file():
        raise LithosError(f"task file {path} does not exist: pass a JSONL file, one JSON object per line")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise LithosError(f"{path} is not UTF-8 text (byte {e.start}): save it as UTF-8 JSONL") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise LithosError(
                f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno}): each line must be one JSON object"
            ) from None
        if not isinstance(obj, dict):
            raise LithosError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        rows.append((lineno, obj))
    if not rows:
        raise LithosError(f"{path} is empty: write one JSON object per line (see docs/eval.md)")
    return rows


def _read_template_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise LithosError(f"template file {path} does not exist")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise LithosError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    except UnicodeDecodeError:
        raise LithosError(f"{path} is not UTF-8 text: save it as UTF-8 JSON") from None
    if isinstance(obj, dict) and set(obj) == {"task"}:
        obj = obj["task"]
    if not isinstance(obj, dict):
        raise LithosError(f"{path}: a template file is one JSON object of task settings")
    return obj


def _check_settings(settings: Mapping[str, Any], where: str) -> None:
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        raise LithosError(
            f"{where}: unknown task setting {', '.join(map(repr, unknown))}; known: {', '.join(SETTINGS)}"
        )
    checks = {
        "name": str,
        "kind": str,
        "format": str,
        "system": (str, type(None)),
        "prompt": str,
        "target": str,
        "fewshot": list,
        "num_fewshot": int,
        "separator": str,
        "stop": list,
        "max_new_tokens": int,
        "match": str,
    }
    for key, value in settings.items():
        if not isinstance(value, checks[key]) or (isinstance(value, bool) and checks[key] is int):
            raise LithosError(f"{where}: task setting {key!r} has the wrong type ({type(value).__name__})")
    if "kind" in settings and settings["kind"] not in KINDS:
        raise LithosError(f"{where}: kind {settings['kind']!r} is not one of {', '.join(KINDS)}")
    if "format" in settings and settings["format"] not in FORMATS:
        raise LithosError(f"{where}: format {settings['format']!r} is not one of {', '.join(FORMATS)}")
    if "match" in settings and settings["match"] not in scoring.MATCH_MODES:
        raise LithosError(f"{where}: match {settings['match']!r} is not one of {', '.join(scoring.MATCH_MODES)}")
    if not all(isinstance(s, str) and s for s in settings.get("stop", [])):
        raise LithosError(f"{where}: 'stop' must be a list of non-empty strings")
    if settings.get("max_new_tokens", 1) < 1:
        raise LithosError(f"{where}: max_new_tokens must be at least 1")


def _infer_kind(path: Path, rows: list[tuple[int, dict[str, Any]]]) -> str:
    lineno, first = rows[0]
    if "choices" in first:
        return "choice"
    if isinstance(first.get("answer"), str) and "####" in first["answer"]:
        return "math"
    raise LithosError(
        f'{path}: no task kind: add a header line {{"task": {{"kind": "math"}}}} or pass --kind ({" | ".join(KINDS)})'
    )


def _check_item(kind: str, template: Template, fields: Mapping[str, Any], where: str) -> None:
    """Every field the templates use or the scorer needs is there, and the answer can be read."""
    needed = set(ANSWER_FIELDS[kind]) | placeholders(template.prompt) - ({"letters"} if kind == "choice" else set())
    for name in sorted(needed):
        if name not in fields:
            raise LithosError(f"{where}: missing field {name!r} (this task's items need {', '.join(sorted(needed))})")
    try:
        if kind == "math":
            scoring.reference_number(fields["answer"])
        elif kind == "choice":
            choices = fields["choices"]
            if not isinstance(choices, list | dict) or not choices:
                raise ValueError("choices must be a non-empty list of strings")
            scoring.reference_letter(fields["answer"], len(choice_list(choices)))
        else:
            scoring.reference_texts(fields["answer"])
    except ValueError as e:
        raise LithosError(f"{where}: {e}") from None


def load_task(
    path: str | Path,
    template: str | Path | None = None,
    kind: str | None = None,
    **overrides: Any,
) -> Task:
    """Read a JSONL task file (and optionally a JSON template file) into a checked `Task`.

    Settings come from, last wins: the kind's defaults, the file's header line, the template
    file, then `kind` and `overrides` (any setting; None values are ignored). Every problem is a
    LithosError naming the file and line.
    """
    path = Path(path)
    rows = _read_jsonl(path)
    settings: dict[str, Any] = {}
    first_line, first = rows[0]
    if set(first) == {"task"} and isinstance(first["task"], dict):
        _check_settings(first["task"], f"{path}:{first_line}")
        settings.update(first["task"])
        rows = rows[1:]
        if not rows:
            raise LithosError(f"{path} has a header but no items: add one JSON object per line after it")
    if template is not None:
        from_file = _read_template_file(Path(template))
        _check_settings(from_file, str(template))
        settings.update(from_file)
    given = {k: v for k, v in dict(overrides, kind=kind).items() if v is not None}
    _check_settings(given, "options")
    settings.update(given)

    kind = settings.get("kind") or _infer_kind(path, rows)
    merged = {**DEFAULTS[kind], **settings}
    fewshot = merged.get("fewshot", [])
    if "num_fewshot" in merged:
        if merged["num_fewshot"] > len(fewshot):
            raise LithosError(f"num_fewshot is {merged['num_fewshot']} but the template has {len(fewshot)} examples")
        fewshot = fewshot[: merged["num_fewshot"]]
    tmpl = Template(
        prompt=merged["prompt"],
        target=merged["target"],
        format=merged.get("format", "chat"),
        system=merged.get("system"),
        fewshot=tuple(fewshot),
        separator=merged.get("separator", "\n\n"),
        stop=tuple(merged.get("stop", ())),
        max_new_tokens=merged["max_new_tokens"],
        match=merged.get("match", "exact"),
    )
    for i, example in enumerate(tmpl.fewshot, start=1):
        where = f"{path}: few-shot example {i}"
        if not isinstance(example, dict):
            raise LithosError(f"{where}: expected a JSON object")
        _check_item(kind, tmpl, example, where)
        missing = placeholders(tmpl.target) - set(template_fields(kind, example))
        if missing:
            raise LithosError(f"{where}: missing field {sorted(missing)[0]!r} used by the target template")

    items: list[Item] = []
    seen: dict[str, int] = {}
    for lineno, fields in rows:
        where = f"{path}:{lineno}"
        if set(fields) == {"task"}:
            raise LithosError(f"{where}: a header line may only be the first line")
        _check_item(kind, tmpl, fields, where)
        item_id = fields.get("id", lineno)
        if not isinstance(item_id, str | int) or isinstance(item_id, bool):
            raise LithosError(f"{where}: 'id' must be a string or an integer")
        item_id = str(item_id)
        if item_id in seen:
            raise LithosError(
                f"{where}: id {item_id!r} is used again (first on line {seen[item_id]}); ids must be unique"
            )
        seen[item_id] = lineno
        items.append(Item(id=item_id, line=lineno, fields=fields))
    return Task(name=merged.get("name", path.stem), kind=kind, path=path, items=tuple(items), template=tmpl)
