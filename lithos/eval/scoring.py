"""Scoring a model's output against an item's answer: numbers, choice letters, exact text.

Each scorer returns a `Score`: whether the output is correct and what was read from it
(`extracted` is None when nothing could be read: an unparsed output, counted as wrong).
Pure functions over strings; no model, no files.
"""

from __future__ import annotations

import dataclasses
import re
import string
import unicodedata
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation
from fractions import Fraction

LETTERS = string.ascii_uppercase


@dataclasses.dataclass(frozen=True)
class Score:
    correct: bool
    extracted: str | None  # what the scorer read from the output; None: nothing it could read


# ---- numbers ---------------------------------------------------------------------------------

# A number as people write it: optional sign and currency, thousands separators, decimals, a
# fraction, an optional percent sign. The look-behind keeps "3-5" from reading as -5 and "x2" as 2.
_NUMBER = re.compile(
    r"(?<![\w.])(?P<sign>[-−])?\s?[$€£]?\s?"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?(?:/\d+)?|\.\d+)"
    r"(?!\d)"
)
_FINAL_MARK = re.compile(r"####")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_ANSWER_PHRASE = re.compile(r"(?:final answer|answer)\s*(?:is|:|=)", re.IGNORECASE)


def parse_number(text: str) -> Fraction | None:
    """The value of the first number in `text` ("$1,234.50" -> 1234.5, "3/4", "-2"), or None."""
    m = _NUMBER.search(text)
    if m is None:
        return None
    raw = m.group("num").replace(",", "")
    try:
        value = Fraction(raw) if "/" in raw else Fraction(Decimal(raw))
    except (ValueError, ZeroDivisionError, InvalidOperation):
        return None
    return -value if m.group("sign") else value


def format_number(value: Fraction) -> str:
    """Canonical text of a number: "18", "-0.5", "2/3" (a fraction only when no short decimal exists)."""
    if value.denominator == 1:
        return str(value.numerator)
    as_decimal = Decimal(value.numerator) / Decimal(value.denominator)
    if Fraction(as_decimal) == value:
        return format(as_decimal.normalize(), "f")
    return f"{value.numerator}/{value.denominator}"


def extract_number(output: str) -> Fraction | None:
    """The final numeric answer in a model's output.

    In order: the first number after the last "####" (GSM8K's marker), inside the last
    `\\boxed{}`, after the last "answer is" / "answer:", else the last number in the text.
    """
    marks = list(_FINAL_MARK.finditer(output))
    if marks:
        found = parse_number(output[marks[-1].end() :])
        if found is not None:
            return found
    boxed = _BOXED.findall(output)
    if boxed:
        found = parse_number(boxed[-1])
        if found is not None:
            return found
    phrases = list(_ANSWER_PHRASE.finditer(output))
    if phrases:
        found = parse_number(output[phrases[-1].end() :])
        if found is not None:
            return found
    numbers = list(_NUMBER.finditer(output))
    if not numbers:
        return None
    return parse_number(numbers[-1].group(0))


def reference_number(answer: str | int | float) -> Fraction:
    """The number a reference answer gives: GSM8K's "...#### 72", or a bare number.

    Raises ValueError with the reason when there is none (the task loader names the line).
    """
    if isinstance(answer, bool):
        raise ValueError(f"answer {answer!r} is not a number")
    if isinstance(answer, int | float):
        return Fraction(Decimal(str(answer)))
    if not isinstance(answer, str):
        raise ValueError(f"answer must be a string or a number, not {type(answer).__name__}")
    if "####" in answer:
        tail = answer.rsplit("####", 1)[1]
        value = parse_number(tail)
        if value is None or _NUMBER.sub("", tail, count=1).strip(" .%\n"):
            raise ValueError(f"the text after '####' is not one number: {tail.strip()[:40]!r}")
        return value
    stripped = answer.strip()
    value = parse_number(stripped)
    if value is None or _NUMBER.fullmatch(stripped) is None:
        raise ValueError(f"answer {stripped[:40]!r} neither ends in '#### <number>' nor is a number")
    return value


def score_math(output: str, answer: str | int | float) -> Score:
    """Correct when the final number in `output` equals the reference number (18 == 18.00)."""
    expected = reference_number(answer)
    got = extract_number(output)
    if got is None:
        return Score(False, None)
    return Score(got == expected, format_number(got))


# ---- multiple choice -------------------------------------------------------------------------

_LETTER_AFTER_PHRASE = re.compile(
    r"(?i:answer|option|choice)\s*(?i:is|:|=)?\s*(?i:option\s+|choice\s+)?[(\[]?([A-Z])[)\]]?(?![A-Za-z])"
)
_LEADING_LETTER = re.compile(r"^\s*[(\[]?([A-Z])(?:[)\].:]|\s*$|\s*\n)")
_PAREN_LETTER = re.compile(r"[(\[]([A-Z])[)\]]")
_BARE_LETTER = re.compile(r"(?<![A-Za-z'])([A-Z])(?![A-Za-z'])")


def choice_letters(n: int) -> str:
    if not 1 <= n <= len(LETTERS):
        raise ValueError(f"a question needs 1 to {len(LETTERS)} choices, got {n}")
    return LETTERS[:n]


def extract_choice(output: str, choices: Sequence[str]) -> str | None:
    """The letter a model chose among `choices` (A for the first), or None when it cannot be told.

    In order: a letter after "answer is" / "answer:" (the last such phrase), a letter that opens
    the reply ("B", "(B)", "B. ..."), the only letter in parentheses, the only choice whose text the
    reply contains, the only bare capital letter among the valid ones.
    """
    letters = choice_letters(len(choices))
    phrased = [m.group(1) for m in _LETTER_AFTER_PHRASE.finditer(output)]
    phrased = [x for x in phrased if x in letters]
    if phrased:
        return phrased[-1]
    m = _LEADING_LETTER.match(output)
    if m and m.group(1) in letters:
        return m.group(1)
    in_parens = {x for x in _PAREN_LETTER.findall(output) if x in letters}
    if len(in_parens) == 1:
        return in_parens.pop()
    text = normalize_text(output)
    named = {letters[i] for i, c in enumerate(choices) if normalize_text(str(c)) and _contains(text, normalize_text(c))}
    if len(named) == 1:
        return named.pop()
    bare = {x for x in _BARE_LETTER.findall(output) if x in letters}
    if len(bare) == 1:
        return bare.pop()
    return None


def reference_letter(answer: str | int, n_choices: int) -> str:
    """The correct letter from an item's answer: a letter ("B", "(b)") or a 0-based index."""
    letters = choice_letters(n_choices)
    if isinstance(answer, bool):
        raise ValueError(f"answer {answer!r} is neither a letter nor an index")
    if isinstance(answer, int):
        if not 0 <= answer < n_choices:
            raise ValueError(f"answer index {answer} is out of range for {n_choices} choices")
        return letters[answer]
    if isinstance(answer, str):
        letter = answer.strip().strip("()[]. ").upper()
        if len(letter) == 1 and letter in letters:
            return letter
        raise ValueError(f"answer {answer!r} is not one of the letters {', '.join(letters)}")
    raise ValueError(f"answer must be a letter or an index, not {type(answer).__name__}")


def score_choice(output: str, choices: Sequence[str], answer: str | int) -> Score:
    expected = reference_letter(answer, len(choices))
    got = extract_choice(output, choices)
    return Score(got == expected, got)


# ---- exact match -----------------------------------------------------------------------------

_PUNCT = "".join(ch for ch in string.punctuation if ch not in "'-") + "“”‘’«»"


def normalize_text(text: str) -> str:
    """Case-folded, NFKC, whitespace collapsed, surrounding punctuation and quotes removed."""
    text = unicodedata.normalize("NFKC", str(text)).casefold()
    text = " ".join(text.split())
    return text.strip(_PUNCT + " '")


def _contains(text: str, phrase: str) -> bool:
    """`phrase` occurs in `text` as whole words."""
    return re.search(rf"(?<!\w){re.escape(phrase)}(?!\w)", text) is not None


MATCH_MODES = ("exact", "contains")


def reference_texts(answer: str | Sequence[str]) -> list[str]:
    """The accepted answers of an exact-match item: one string or a list of strings."""
    if isinstance(answer, str):
        answers = [answer]
    elif isinstance(answer, list | tuple) and answer and all(isinstance(a, str) for a in answer):
        answers = list(answer)
    else:
        raise ValueError("answer must be a string or a non-empty list of strings")
    if not any(normalize_text(a) for a in answers):
        raise ValueError("answer is empty after normalization (only spaces or punctuation)")
    return answers


def score_exact(output: str, answer: str | Sequence[str], match: str = "exact") -> Score:
    """Correct when the normalized output equals one accepted answer (`match="exact"`), or
    contains one as whole words (`match="contains"`)."""
    if match not in MATCH_MODES:
        raise ValueError(f"match must be one of {MATCH_MODES}, got {match!r}")
    text = normalize_text(output)
    for accepted in reference_texts(answer):
        want = normalize_text(accepted)
        if want and (text == want if match == "exact" else _contains(text, want)):
            return Score(True, accepted)
    return Score(False, text or None)
