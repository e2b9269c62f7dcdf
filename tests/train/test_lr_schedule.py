"""The trainers' learning-rate shapes."""
from __future__ import annotations

import pytest

from dflash_tfm.train.lr_schedule import lr_factor


def test_wsd_schedule_shape() -> None:
    f = [lr_factor(s, 1000, "wsd") for s in range(1000)]
    assert f[0] < 0.05 and f[39] == 1.0 and f[500] == 1.0 and f[799] == 1.0
    assert f[900] == pytest.approx(0.5, abs=0.01) and f[-1] < 0.01
    assert all(a >= b for a, b in zip(f[40:], f[41:]))


def test_cosine_warms_up_then_decays_to_zero_and_constant_holds_the_peak() -> None:
    cosine = [lr_factor(s, 100, "cosine", warmup_frac=0.1) for s in range(100)]
    assert cosine[0] == pytest.approx(0.1) and cosine[9] == 1.0 and cosine[-1] < 0.01
    assert all(a >= b for a, b in zip(cosine[9:], cosine[10:]))
    constant = [lr_factor(s, 100, "constant", warmup_frac=0.1) for s in range(100)]
    assert constant[:10] == cosine[:10] and set(constant[9:]) == {1.0}


def test_unknown_schedule_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="cosine, wsd, constant"):
        lr_factor(0, 10, "linear")
