"""`bench_verify_step`'s L2 prefetch settings: parsed from the command line, or built from `bench_l2_prefetch`'s
best setting per window."""
from __future__ import annotations

import json

import pytest

from benchmarks.bench_verify_step import prefetch_setting, settings_from


def test_prefetch_setting_parses_sizes_and_optional_layouts() -> None:
    assert prefetch_setting("32:8") == {"mixer": 32 << 20, "short": 8 << 20}
    assert prefetch_setting("32:0:strided:rows") == {"mixer": 32 << 20, "short": 0, "mixer_layout": "strided",
                                                     "short_layout": "rows"}
    with pytest.raises(SystemExit, match="expected MIXER:SHORT"):
        prefetch_setting("32:8:strided")


@pytest.mark.parametrize("short_best, expect", [
    ({"mib": 8, "layout": "rows"}, ["0:0", "32:0:strided:prefix", "0:8:prefix:rows", "32:8:strided:rows"]),
    (None, ["0:0", "32:0:strided:prefix"]),
])
def test_settings_from_best_per_window(tmp_path, short_best: dict | None, expect: list[str]) -> None:
    """No prefetch, each window's best alone, and both together only when both windows have a best."""
    found = {"rows": 65, "mixer": {"best": {"mib": 32, "layout": "strided"}}, "short": {"best": short_best}}
    path = tmp_path / "l2_prefetch.json"
    path.write_text(json.dumps(found))
    assert settings_from(str(path)) == expect
    for setting in expect:
        prefetch_setting(setting)  # each one parses
