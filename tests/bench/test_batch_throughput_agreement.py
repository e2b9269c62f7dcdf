"""The serving benchmark's comparison with autoregressive outputs: equal requests, and how far each agrees."""
from benchmarks.batch_throughput import agreement


def test_agreement_counts_equal_requests_and_the_share_before_the_first_difference() -> None:
    reference = {0: [1, 2, 3, 4], 1: [5, 6, 7, 8], 2: [9, 9]}
    outputs = {0: [1, 2, 3, 4], 1: [5, 6, 0, 0], 2: [8, 9]}
    equal, share = agreement(outputs, reference)
    assert equal == "1/3"
    assert share == (1.0 + 0.5 + 0.0) / 3
