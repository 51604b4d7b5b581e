"""The SFT warm-up's worked solutions: each family's working, hand-checked, and never an answer
that differs from the data's."""

from __future__ import annotations

import pytest

from rlfleet.tasks.basic_math_solutions import LEGS, NoSolution, worked_solution


def test_two_term_arithmetic_in_one_line():
    assert worked_solution("basic_arithmetic", "Calculate 69 - 90.", "-21") == (
        "69 - 90 = -21\nAnswer: -21"
    )
    assert worked_solution("basic_arithmetic", "Calculate 5 * 33.", "165") == (
        "5 * 33 = 165\nAnswer: 165"
    )


def test_a_product_of_two_digit_numbers_is_split_by_place_value():
    assert worked_solution("basic_arithmetic", "Calculate 66 * 85.", 5610) == (
        "66 * 85 = 66 * 80 + 66 * 5 = 5280 + 330 = 5610\nAnswer: 5610"
    )


def test_a_chain_sum_one_operation_a_line():
    question = "State the final answer to the following arithmetic problem: 4 - 1 - 7 ="
    assert worked_solution("chain_sum", question, "-4") == "4 - 1 = 3\n3 - 7 = -4\nAnswer: -4"


def test_legs_per_animal_then_the_total():
    question = (
        "Your task is to count how many legs there are in total when given a list of animals."
        "\n\nNow, how many legs are there in total if you have 2 shrimps, 3 praying mantiss?\n"
    )
    assert worked_solution("leg_counting", question, "38") == (
        "2 shrimps: 2 * 10 = 20 legs\n3 praying mantiss: 3 * 6 = 18 legs\n"
        "Total: 20 + 18 = 38\nAnswer: 38"
    )
    one = "Now, how many legs are there in total if you have 1 starfish?\n"
    assert worked_solution("leg_counting", one, "5") == "1 starfish: 1 * 5 = 5 legs\nAnswer: 5"


def test_the_leg_table_is_reasoning_gyms():
    animals = pytest.importorskip("reasoning_gym.arithmetic.leg_counting").ANIMALS
    assert dict(animals) == LEGS


def test_a_letter_counted_word_by_word_whatever_its_case():
    question = 'How many times does the letter "v" appear in the text: "Verne of vivid"?'
    assert worked_solution("letter_counting", question, "3") == (
        "Verne: 1\nof: 0\nvivid: 2\nTotal: 1 + 0 + 2 = 3\nAnswer: 3"
    )


def test_the_larger_number_first():
    question = "Which number is larger, 31 or 39?"
    assert worked_solution("number_comparison", question, "39") == "39 > 31\nAnswer: 39"


def test_working_that_disagrees_with_the_data_is_refused():
    with pytest.raises(ValueError, match="worked 7, the data says 8"):
        worked_solution("basic_arithmetic", "Calculate 3 + 4.", "8")


@pytest.mark.parametrize(
    ("family", "question"),
    [
        ("geometry", "What is the area of a unit square?"),
        ("basic_arithmetic", "What is 3 plus 4?"),
        ("leg_counting", "how many legs are there in total if you have 2 unicorns?"),
    ],
)
def test_a_question_it_cannot_read_is_named(family, question):
    with pytest.raises(NoSolution):
        worked_solution(family, question, "0")
