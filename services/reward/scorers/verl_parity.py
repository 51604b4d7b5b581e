"""verl's default rewards for its own data-source names, reproduced exactly.

Why: a recipe moved from verl must train on the reward it trained on there. Under
``openai/gsm8k`` and the MATH names verl's ``default_compute_score`` is strict in ways
rlfleet's own scorers are not (measured on 300 generated GSM8K responses: 76 scored 1 by
rlfleet's lenient ``gsm8k`` and 0 by verl's, never the reverse), so those names select these
scorers, and the better ones keep rlfleet's names (``gsm8k_flexible``, ``math``). What verl
does (read in verl 0.9.1, ``verl/utils/reward_score/{__init__,gsm8k,math_reward}.py``; this
is a re-implementation of that behaviour, not a copy of its code):

``openai/gsm8k`` (``gsm8k.compute_score``, strict, ``format_score`` 0, ``score`` 1):
only the last 300 characters of the response are read; the answer is the last match of
``#### `` (one space, required) followed by ``-?[0-9.,]+``; its commas are removed; it scores
1 when that *string* equals the ground truth, else 0. So ``####327``, ``#### $989``,
``#### 42.0`` for 42, and a right answer followed by 300 characters of anything score 0.

``lighteval/MATH``, ``DigitalLearningGmbH/MATH-lighteval``, ``HuggingFaceH4/MATH-500``
(``math_reward.compute_score``, from lm-evaluation-harness' hendrycks_math): the answer is
the last ``\\boxed`` expression (``\\boxed{...}`` with balanced braces, or the text after the
last ``\\boxed `` up to a ``$``); an ``\\fbox{...}`` is found but then refused, so it scores 0;
answer and ground truth are normalised as strings (``strip_string``, below) and compared;
anything that raises scores 0. There is no numeric or symbolic equivalence: ``0.75`` is not
``\\frac{3}{4}``, and only the literal ``0.5`` becomes ``\\frac{1}{2}``.

Other names verl knows (``math_dapo``, ``aime*``, ``numina_*``, code sets) are not covered
here; in verl a name it does not know is an error, here it falls to rlfleet's selection.
"""

from __future__ import annotations

import re
from typing import Any

GSM8K_SOURCES = ["openai/gsm8k"]
MATH_SOURCES = ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"]
GSM8K_CLIP_CHARS = 300
_GSM8K_STRICT = re.compile(r"#### (-?[0-9.,]+)")


class _Refused(Exception):
    """Where verl's code fails an ``assert`` or indexes past a string's end: the item
    scores 0 (or, inside ``is_equiv``, falls back to comparing the raw strings)."""


# --- openai/gsm8k ----------------------------------------------------------------------


def gsm8k_strict_answer(solution: str) -> str | None:
    """The text after the last ``#### `` in the last 300 characters, commas removed."""
    found = _GSM8K_STRICT.findall(solution[-GSM8K_CLIP_CHARS:])
    return found[-1].replace(",", "").replace("$", "") if found else None


def verl_gsm8k_score(solution_str: str, ground_truth: Any, **_: Any) -> dict:
    answer = gsm8k_strict_answer(solution_str)
    correct = answer is not None and answer == ground_truth  # a string compare, as in verl
    return {"score": float(correct), "acc": float(correct), "extracted": float(answer is not None)}


# --- the MATH names ----------------------------------------------------------------------


def last_boxed(text: str) -> str | None:
    """The last ``\\boxed`` expression *with* its wrapper, verl's way (see module docstring)."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    if start < 0:
        return None
    depth = 0
    for index in range(start, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[start : index + 1]
    return None


def unbox(boxed: str) -> str:
    """The content of ``\\boxed{...}`` or ``\\boxed ...``; _Refused for anything else
    (``\\fbox{...}`` included)."""
    if "\\boxed " in boxed:
        return _strip_prefix(boxed, "\\boxed ")
    if not boxed.endswith("}"):
        raise _Refused(boxed)
    return _strip_prefix(boxed, "\\boxed{")[:-1]


def _strip_prefix(text: str, prefix: str) -> str:
    if not text.startswith(prefix):
        raise _Refused(text)
    return text[len(prefix) :]


def equivalent(answer: Any, truth: Any) -> bool:
    """Normalised strings equal; when normalising fails, the raw values equal."""
    if answer is None or truth is None:
        return answer is None and truth is None
    try:
        return normalise(answer) == normalise(truth)
    except (_Refused, AttributeError, TypeError):  # verl: any exception -> raw compare
        return answer == truth


def verl_math_score(solution_str: str, ground_truth: Any, **_: Any) -> dict:
    boxed = last_boxed(solution_str)
    try:
        correct = boxed is not None and equivalent(unbox(boxed), ground_truth)
    except _Refused:
        correct = False
    return {"score": float(correct), "acc": float(correct), "boxed": float(boxed is not None)}


# --- strip_string: verl's (lm-evaluation-harness') normalisation, step by step -------------

_DROPPED = ["\n", "\\!"]
_RENAMED = [
    ("\\\\", "\\"),
    ("tfrac", "frac"),
    ("dfrac", "frac"),
    ("\\left", ""),
    ("\\right", ""),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\$", ""),
]


def normalise(text: str) -> str:
    """verl's ``strip_string``: the same replacements in the same order. A non-string raises
    AttributeError, as there; a malformed ``\\sqrt``/``\\frac``/units raises _Refused."""
    for dropped in _DROPPED:
        text = text.replace(dropped, "")
    for old, new in _RENAMED:
        text = text.replace(old, new)
    text = _drop_right_units(text)
    text = text.replace("\\\\%", "").replace("\\%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 3" -> "3"
        text = sides[1]
    text = _brace_sqrt(text).replace(" ", "")
    text = _brace_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _slash_to_frac(text)


def _drop_right_units(text: str) -> str:
    """Everything before ``\\text{ `` (with the space); two of them are refused."""
    if "\\text{ " not in text:
        return text
    parts = text.split("\\text{ ")
    if len(parts) != 2:
        raise _Refused(text)
    return parts[0]


def _brace_sqrt(text: str) -> str:
    """``\\sqrt3`` -> ``\\sqrt{3}`` (one character); a ``\\sqrt`` at the end is refused."""
    if "\\sqrt" not in text:
        return text
    first, *rest = text.split("\\sqrt")
    pieces = [first]
    for part in rest:
        if not part:
            raise _Refused(text)
        pieces.append("\\sqrt" + (part if part[0] == "{" else "{" + part[0] + "}" + part[1:]))
    return "".join(pieces)


def _brace_fracs(text: str) -> str:
    """``\\frac12`` -> ``\\frac{1}{2}``, ``\\frac1{72}`` -> ``\\frac{1}{72}``; a ``\\frac``
    at the end is refused; one followed by a single character leaves the text unchanged."""
    first, *rest = text.split("\\frac")
    pieces = [first]
    for part in rest:
        if not part:
            raise _Refused(text)
        if part[0] == "{":
            pieces.append("\\frac" + part)
        elif len(part) < 2:
            return text
        elif part[1] != "{":
            pieces.append("\\frac{" + part[0] + "}{" + part[1] + "}" + part[2:])
        else:
            pieces.append("\\frac{" + part[0] + "}" + part[1:])
    return "".join(pieces)


def _slash_to_frac(text: str) -> str:
    """``3/4`` -> ``\\frac{3}{4}`` when both sides are integers written plainly."""
    sides = text.split("/")
    if len(sides) != 2:
        return text
    try:
        top, bottom = int(sides[0]), int(sides[1])
    except ValueError:
        return text
    return f"\\frac{{{top}}}{{{bottom}}}" if text == f"{top}/{bottom}" else text
