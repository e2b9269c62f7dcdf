"""The FP8 agreement script's measures: the final answer of an output and where two outputs first differ."""
from benchmarks.fp8_agreement import final_answer, first_difference


def test_final_answer_is_the_last_number() -> None:
    assert final_answer("She sold 48 + 24 = 72 clips.\n#### 1,072.") == "1072"
    assert final_answer("-3.5 then 7.25") == "7.25" and final_answer("no digits") is None


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
