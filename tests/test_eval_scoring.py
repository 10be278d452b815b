"""Scoring functions on hand-made outputs: correct, wrong and malformed answers."""

from __future__ import annotations

from fractions import Fraction

import pytest

from lithos.eval.scoring import (
    extract_choice,
    extract_number,
    format_number,
    normalize_text,
    reference_letter,
    reference_number,
    score_choice,
    score_exact,
    score_math,
)


@pytest.mark.parametrize(
    "output, expected",
    [
        ("Natalia sold 48/2 = 24 clips in May.\nShe sold 48 + 24 = 72 clips.\n#### 72", 72),
        ("#### 1,234", 1234),
        ("The answer is $18.", 18),
        ("The answer is $1,234.50 in total.", Fraction("1234.5")),
        ("So the final answer is \\boxed{42}.", 42),
        ("Answer: -7 degrees", -7),
        ("First 3 + 4 = 7, then 7 * 2 = 14 apples.", 14),  # no marker: the last number
        ("It costs 0.5 dollars, i.e. 50%", 50),
        ("The ratio is 3/4", Fraction(3, 4)),
        ("The answer is 12. Check: 3 * 4 = 12.", 12),
        ("Between 3-5 people", 5),  # a range is not a negative number
        ("#### 72\n\nQuestion: next one has 9", 72),  # the marker wins over later numbers
    ],
)
def test_extract_number(output, expected):
    assert extract_number(output) == expected


@pytest.mark.parametrize("output", ["", "I don't know.", "The answer is many.", "####"])
def test_extract_number_finds_none(output):
    assert extract_number(output) is None


def test_reference_number_reads_gsm8k_answers_and_bare_numbers():
    assert reference_number("She sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == 72
    assert reference_number("#### 7,006,652") == 7006652
    assert reference_number("#### -3.5") == Fraction(-7, 2)
    assert reference_number(15) == 15
    assert reference_number(2.5) == Fraction(5, 2)
    assert reference_number(" 42 ") == 42


@pytest.mark.parametrize("answer", ["no marker here", "#### ten", "#### 5 apples", "", True, None, [1]])
def test_reference_number_rejects_malformed_answers(answer):
    with pytest.raises(ValueError):
        reference_number(answer)


def test_score_math_correct_wrong_unparsed():
    assert score_math("5 + 13 = 18\n#### 18", "#### 18").correct
    assert score_math("The total is 18.00 dollars.", 18).correct  # 18.00 == 18
    wrong = score_math("1234 * 5678 = 7321088", "#### 7,006,652")
    assert not wrong.correct and wrong.extracted == "7321088"
    unparsed = score_math("I cannot solve this.", "#### 3")
    assert not unparsed.correct and unparsed.extracted is None


def test_format_number():
    assert [format_number(Fraction(x)) for x in ("18", "-0.5", "2/3", "1234.50")] == ["18", "-0.5", "2/3", "1234.5"]


CHOICES = ["Paris", "London", "Berlin", "Madrid"]


@pytest.mark.parametrize(
    "output, letter",
    [
        ("A", "A"),
        ("B. London", "B"),
        ("(C)", "C"),
        ("The answer is D.", "D"),
        ("Answer: (B) London", "B"),
        ("I think the correct option is C because ...", "C"),
        ("The capital of France is Paris.", "A"),  # names exactly one choice
        ("B is right.", "B"),  # the only bare valid capital letter
        ("A bird says the answer is C", "C"),  # "A" the article does not count once an answer is named
    ],
)
def test_extract_choice(output, letter):
    assert extract_choice(output, CHOICES) == letter


@pytest.mark.parametrize(
    "output",
    [
        "",
        "I am not sure.",
        "Either Paris or Berlin.",  # two choices named
        "A or B",  # two letters
        "The answer is E.",  # not a valid letter for four choices
        "a",  # a lowercase word, not a letter
    ],
)
def test_extract_choice_finds_none(output):
    assert extract_choice(output, CHOICES) is None


def test_score_choice_and_reference_letters():
    assert score_choice("The answer is B.", CHOICES, "B").correct
    assert score_choice("The answer is B.", CHOICES, 1).correct  # 0-based index
    wrong = score_choice("C. Berlin", CHOICES, "A")
    assert not wrong.correct and wrong.extracted == "C"
    assert reference_letter("c", 4) == "C"
    for bad in ("E", 4, "AB", True, 1.0):
        with pytest.raises(ValueError):
            reference_letter(bad, 4)


def test_score_exact():
    assert normalize_text('  "Paris."  ') == "paris"
    assert score_exact("Paris.", "paris").correct
    assert score_exact("PARIS", ["Paris", "City of Light"]).correct
    assert not score_exact("The capital is Paris.", "Paris").correct
    assert score_exact("The capital is Paris.", "Paris", match="contains").correct
    assert not score_exact("Parisian food", "Paris", match="contains").correct  # whole words only
    unparsed = score_exact("", "Paris")
    assert not unparsed.correct and unparsed.extracted is None
    for bad in ("", [], [3], None, "...!"):
        with pytest.raises(ValueError):
            score_exact("x", bad)
    with pytest.raises(ValueError, match="match must be one of"):
        score_exact("x", "x", match="fuzzy")
