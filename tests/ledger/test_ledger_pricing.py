"""Pricing: the cached-input discount formula, the TOML and flag formats, their errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixserve.ledger import ModelPrice, Pricing, PricingError


def test_cost_applies_the_cached_discount_exactly() -> None:
    pricing = Pricing.from_specs(["m=2,0.5,8"])
    # 600 computed * 2 + 400 cached * 0.5 + 50 out * 8 = 1200 + 200 + 400 micro-USD
    assert pricing.cost("m", 1000, 400, 50) == 1800 / 1e6
    assert pricing.cost("m", 1000, 0, 0) == 2000 / 1e6
    assert pricing.cost("m", 1000, 1000, 0) == 500 / 1e6


def test_issue_example_prices() -> None:
    price = ModelPrice(input=0.15, cached_input=0.075, output=0.6)
    expected = ((1_000_000 - 250_000) * 0.15 + 250_000 * 0.075 + 10_000 * 0.6) / 1e6
    assert price.cost(1_000_000, 250_000, 10_000) == expected
    assert price.cost(1_000_000, 250_000, 10_000) == pytest.approx(0.13725)  # 112500 + 18750 + 6000 micro-USD


def test_default_pricing_is_free() -> None:
    assert Pricing.default().cost("anything", 10, 5, 3) == 0.0


def test_from_toml_models_default_and_cached_fallback(tmp_path: Path) -> None:
    path = tmp_path / "prices.toml"
    path.write_text(
        """
[default]
input = 1.0
output = 4.0

[models."SmolLM2-135M-Instruct"]
input = 0.15
cached_input = 0.075
output = 0.6
"""
    )
    pricing = Pricing.from_toml(str(path))
    assert pricing.price_of("SmolLM2-135M-Instruct") == ModelPrice(0.15, 0.075, 0.6)
    # the default table has no cached_input: cached input is billed at the full input price
    assert pricing.price_of("other") == ModelPrice(1.0, 1.0, 4.0)


def test_unlisted_model_without_default_is_free(tmp_path: Path) -> None:
    path = tmp_path / "prices.toml"
    path.write_text("[models.a]\ninput = 1\ncached_input = 0.5\noutput = 2\n")
    pricing = Pricing.from_toml(str(path))
    assert pricing.cost("a", 2, 1, 1) == 3.5 / 1e6  # 1 * 1 + 1 * 0.5 + 1 * 2
    assert pricing.cost("b", 2, 1, 1) == 0.0


@pytest.mark.parametrize(
    "text",
    [
        "[models.a]\ninput = 1\ncache_input = 0.5\noutput = 2\n",  # typo'd key
        "[models.a]\ninput = -1\noutput = 2\n",  # negative
        '[models.a]\ninput = "cheap"\noutput = 2\n',  # not a number
        "[models.a]\ninput = 1\n",  # output missing
        "[prices]\ninput = 1\noutput = 2\n",  # unknown table
        "[default]\ninput = nan\noutput = 1\n",  # not finite
        "[default\n",  # not TOML
    ],
)
def test_bad_pricing_files_raise(tmp_path: Path, text: str) -> None:
    path = tmp_path / "prices.toml"
    path.write_text(text)
    with pytest.raises(PricingError):
        Pricing.from_toml(str(path))


def test_flags_overlay_a_file_and_star_sets_the_default() -> None:
    base = Pricing.from_specs(["a=1,1,1", "b=2,2,2"])
    pricing = Pricing.from_specs(["b=3,1.5,6", "*=0.5,0.25,1"], base=base)
    assert pricing.price_of("a") == ModelPrice(1, 1, 1)
    assert pricing.price_of("b") == ModelPrice(3, 1.5, 6)
    assert pricing.price_of("zzz") == ModelPrice(0.5, 0.25, 1)
    assert base.price_of("b") == ModelPrice(2, 2, 2)  # the base is untouched


@pytest.mark.parametrize("spec", ["a=1,2", "=1,2,3", "a:1,2,3", "a=1,x,3", "a=1,-2,3"])
def test_bad_flags_raise(spec: str) -> None:
    with pytest.raises(PricingError):
        Pricing.from_specs([spec])
