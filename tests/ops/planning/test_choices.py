"""The choices count every bit they store and register through one door."""

from __future__ import annotations

import pytest

import surgery
from surgery.core.errors import ConfigError
from surgery.ops.planning.choices import CHOICES, Choice, choice_named


@pytest.mark.parametrize(
    ("name", "bpw"),
    [
        ("dense", 16),
        ("int8", 8 + 16 / 256),
        ("w4g128", 4 + 16 / 128),
        ("w3g128", 3 + 16 / 128),
        ("fp8", 8 + 16 / 256),
        ("mxfp4", 4.25),
        ("nvfp4", 4.5 + 32 / (64 * 256)),
        ("2:4", 9),
    ],
)
def test_bits_per_weight_include_scales_and_metadata(name, bpw):
    assert choice_named(name).bits_per_weight((64, 256)) == pytest.approx(bpw)


def test_a_registered_choice_is_a_choice_and_a_bad_name_lists_the_allowed():
    mine = Choice("keep", lambda s: s[0] * s[1] * 16, CHOICES["dense"].apply)
    surgery.register_choice(mine)
    try:
        assert choice_named("keep") is mine
    finally:
        CHOICES.unregister("keep")
    with pytest.raises(ConfigError, match=r"^plan\.choices='w5': must be one of dense, int8, w4g128"):
        choice_named("w5")
