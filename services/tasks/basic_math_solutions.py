"""Worked solutions for the basic_math families: the demonstrations of the SFT warm-up.

Why: demonstrations that give only ``Answer: N`` taught this 135M model the answer's form in a
few steps, but left it answering in ~5 tokens with low entropy: its GRPO groups then agreed
more often (less signal) and arithmetic fell back (docs/real_model.md, "An SFT warm-up"). A
worked solution shows a method the model can run in its own tokens, one small step per line,
as the GSM8K and MATH solutions that SFT sets are made of do (Cobbe et al. 2021, "Training
Verifiers to Solve Math Word Problems"): a chain sum one operation at a time, legs per animal
then their total, the letter counted word by word, a product split by place value. Every
solution is computed from the question and checked against the row's ground truth, so a
demonstration never teaches a wrong answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable

LEGS = {
    **dict.fromkeys(("snake", "sea slug", "jellyfish", "flatworm", "leech"), 0),
    **dict.fromkeys(("chicken", "bird", "human", "duck"), 2),
    **dict.fromkeys(
        ("dog", "cat", "cow", "horse", "lion", "elephant", "giraffe", "tiger", "deer", "sheep"), 4
    ),
    "starfish": 5,
    **dict.fromkeys(
        (
            "insect",
            "ant",
            "butterfly",
            "beetle",
            "bee",
            "wasp",
            "grasshopper",
            "cricket",
            "cockroach",
            "praying mantis",
            "firefly",
        ),
        6,
    ),
    **dict.fromkeys(("spider", "scorpion"), 8),
    **dict.fromkeys(("crab", "lobster", "shrimp"), 10),
    "woodlouse": 14,
}
"""Legs per animal, as reasoning-gym's ``leg_counting`` counts them (its generator's animals)."""

_TWO_TERMS = re.compile(r"Calculate (-?\d+) ([-+*]) (-?\d+)\.")
_CHAIN = re.compile(r"problem: ((?:-?\d+ [-+] )+-?\d+) =")
_ANIMALS = re.compile(r"if you have (.+)\?")
_LETTER = re.compile(r'the letter "(.)" appear in the text: "(.*)"\?')
_TWO_NUMBERS = re.compile(r"larger, (-?\d+) or (-?\d+)\?")


class NoSolution(ValueError):
    """The question is not in a form this module knows how to solve."""


def worked_solution(family: str, question: str, ground_truth: object) -> str:
    """The demonstration for one problem: a few short lines of working, then ``Answer: N``.

    Raises ``NoSolution`` for a question it cannot parse and ``ValueError`` when its working
    does not reach ``ground_truth``."""
    try:
        solve = SOLVERS[family]
    except KeyError:
        raise NoSolution(f"no worked solutions for the family {family!r}") from None
    lines, answer = solve(question)
    if str(answer) != str(ground_truth).strip():
        raise ValueError(f"{family}: worked {answer}, the data says {ground_truth}: {question!r}")
    return "\n".join([*lines, f"Answer: {answer}"])


def _match(pattern: re.Pattern[str], question: str) -> re.Match[str]:
    found = pattern.search(question)
    if found is None:
        raise NoSolution(f"cannot read the question: {question!r}")
    return found


def _apply(left: int, operator: str, right: int) -> int:
    return {"+": left + right, "-": left - right, "*": left * right}[operator]


def arithmetic(question: str) -> tuple[list[str], int]:
    """``a op b``; a product of two numbers of two digits or more is split by place value."""
    a, operator, b = _match(_TWO_TERMS, question).groups()
    left, right = int(a), int(b)
    result = _apply(left, operator, right)
    if operator == "*" and abs(left) >= 10 and abs(right) >= 10:
        tens, units = right - right % 10, right % 10
        parts = f"{left} * {tens} + {left} * {units} = {left * tens} + {left * units}"
        return [f"{left} * {right} = {parts} = {result}"], result
    return [f"{left} {operator} {right} = {result}"], result


def chain_sum(question: str) -> tuple[list[str], int]:
    """``a op b op c ...`` one operation a line, left to right."""
    tokens = _match(_CHAIN, question).group(1).split()
    total, lines = int(tokens[0]), []
    for operator, term in zip(tokens[1::2], tokens[2::2], strict=True):
        step = _apply(total, operator, int(term))
        lines.append(f"{total} {operator} {term} = {step}")
        total = step
    return lines, total


def leg_counting(question: str) -> tuple[list[str], int]:
    """Legs of each kind of animal (count x legs), then the total."""
    lines, counts = [], []
    for item in _match(_ANIMALS, question).group(1).split(", "):
        number, name = item.split(" ", 1)
        legs = _legs_of(name, int(number))
        lines.append(f"{number} {name}: {number} * {legs} = {int(number) * legs} legs")
        counts.append(int(number) * legs)
    total = sum(counts)
    if len(counts) > 1:
        lines.append(f"Total: {' + '.join(map(str, counts))} = {total}")
    return lines, total


def _legs_of(name: str, number: int) -> int:
    """Legs of one animal named as the question names it (plural: the name plus "s")."""
    singular = name[:-1] if number > 1 and name.endswith("s") and name[:-1] in LEGS else name
    if singular not in LEGS:
        raise NoSolution(f"no leg count for the animal {name!r}")
    return LEGS[singular]


def letter_counting(question: str) -> tuple[list[str], int]:
    """The letter counted in each word (case does not matter), then the total."""
    letter, text = _match(_LETTER, question).groups()
    words = text.split()
    counts = [word.lower().count(letter.lower()) for word in words]
    lines = [f"{word}: {count}" for word, count in zip(words, counts, strict=True)]
    lines.append(f"Total: {' + '.join(map(str, counts))} = {sum(counts)}")
    return lines, sum(counts)


def number_comparison(question: str) -> tuple[list[str], int]:
    first, second = (int(n) for n in _match(_TWO_NUMBERS, question).groups())
    larger, smaller = max(first, second), min(first, second)
    return [f"{larger} > {smaller}"], larger


SOLVERS: dict[str, Callable[[str], tuple[list[str], int]]] = {
    "basic_arithmetic": arithmetic,
    "chain_sum": chain_sum,
    "leg_counting": leg_counting,
    "letter_counting": letter_counting,
    "number_comparison": number_comparison,
}
"""Each basic_math family's solver: the question's text -> (lines of working, the answer)."""
