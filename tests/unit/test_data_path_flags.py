"""The data path's flags (issue 16): --relay and --dial-hedge-delay, validated like the rest."""

from __future__ import annotations

import pytest

from extractedprism.config.table import ConfigError, validate


def config(**values: str):  # type: ignore[no-untyped-def]
    return validate({"endpoints": "127.0.0.1:6443", **values})


def test_defaults():
    cfg = config()
    assert cfg.relay == "auto"
    assert cfg.dial_hedge_delay == pytest.approx(0.25)


@pytest.mark.parametrize(("text", "seconds"), [("0", 0.0), ("0s", 0.0), ("100ms", 0.1),
                                               ("1s", 1.0)])
def test_hedge_delay_values(text, seconds):
    assert config(dial_hedge_delay=text).dial_hedge_delay == pytest.approx(seconds)


@pytest.mark.parametrize(("text", "needle"), [
    ("-1s", "--dial-hedge-delay (-1s) must not be negative"),
    ("soon", "--dial-hedge-delay (soon) is invalid"),
    ("nan", "--dial-hedge-delay (nan)"),
])
def test_bad_hedge_delay(text, needle):
    with pytest.raises(ConfigError) as info:
        config(dial_hedge_delay=text)
    assert any(needle in p for p in info.value.problems), info.value.problems


@pytest.mark.parametrize("relay", ["auto", "native", "python"])
def test_relay_values(relay):
    assert config(relay=relay).relay == relay


def test_bad_relay():
    with pytest.raises(ConfigError) as info:
        config(relay="Native")
    assert info.value.problems == [
        "--relay (Native) is invalid: must be one of auto, native, python"]
