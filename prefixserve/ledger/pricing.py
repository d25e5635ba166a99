"""Per-model token prices (USD per million tokens) with a discounted rate for cached input.

TOML shape (every table optional; a model without a row falls back to `[default]`, else is free):

    [default]
    input = 0.15
    cached_input = 0.075      # optional; defaults to `input` (no discount)
    output = 0.6

    [models."SmolLM2-135M-Instruct"]
    input = 0.15
    cached_input = 0.075
    output = 0.6

Flag shape (`Pricing.from_specs`): "MODEL=INPUT,CACHED_INPUT,OUTPUT", MODEL "*" for the default.
Pricing is immutable, so one instance may be shared by any number of threads.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

_PRICE_KEYS = ("input", "cached_input", "output")


class PricingError(ValueError):
    """The pricing file or flag is malformed (unknown key, negative or non-numeric price)."""


@dataclass(frozen=True, slots=True)
class ModelPrice:
    """USD per million tokens. `cached_input` applies to prompt tokens served from the cache."""

    input: float = 0.0
    cached_input: float = 0.0
    output: float = 0.0

    def __post_init__(self) -> None:
        for name in _PRICE_KEYS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise PricingError(f"price {name} must be a number, not {value!r}")
            if not math.isfinite(value) or value < 0:
                raise PricingError(f"price {name} must be finite and >= 0, not {value!r}")

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        """USD for one request: computed prompt, cached prompt and output tokens at their rates."""
        micro_usd = (
            (prompt_tokens - cached_tokens) * self.input
            + cached_tokens * self.cached_input
            + completion_tokens * self.output
        )
        return micro_usd / 1_000_000


FREE = ModelPrice()


@dataclass(frozen=True, slots=True)
class Pricing:
    """Prices by model name; `fallback` (the TOML's [default]) prices every model not listed.

    With no fallback an unlisted model costs 0 (its tokens are still counted).
    """

    models: Mapping[str, ModelPrice] = field(default_factory=lambda: MappingProxyType({}))
    fallback: ModelPrice | None = None

    @classmethod
    def default(cls) -> Pricing:
        """Everything free: the ledger still counts tokens, costs are 0."""
        return cls()

    @classmethod
    def from_toml(cls, path: str) -> Pricing:
        """Parse a pricing file (shape in the module docstring). Raises PricingError or OSError."""
        with open(path, "rb") as f:
            try:
                doc = tomllib.load(f)
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:  # not TOML, or not UTF-8 text
                raise PricingError(f"{path}: {e}") from e
        return cls.from_mapping(doc, source=path)

    @classmethod
    def from_mapping(cls, doc: Mapping[str, Any], source: str = "pricing") -> Pricing:
        unknown = set(doc) - {"default", "models"}
        if unknown:
            raise PricingError(
                f"{source}: unknown table(s) {sorted(unknown)}; use [default] and [models.NAME]"
            )
        fallback = _price_table(doc["default"], f"{source} [default]") if "default" in doc else None
        models_doc = doc.get("models", {})
        if not isinstance(models_doc, Mapping):
            raise PricingError(f"{source}: [models] must be a table of tables")
        models = {str(name): _price_table(t, f"{source} [models.{name!r}]") for name, t in models_doc.items()}
        return cls(models=MappingProxyType(models), fallback=fallback)

    @classmethod
    def from_specs(cls, specs: Iterable[str], base: Pricing | None = None) -> Pricing:
        """Overlay "MODEL=INPUT,CACHED_INPUT,OUTPUT" flags ("*" = default) on `base` (or nothing)."""
        models = dict(base.models) if base else {}
        fallback = base.fallback if base else None
        for spec in specs:
            name, sep, values = spec.rpartition("=")
            parts = values.split(",")
            if not sep or not name or len(parts) != 3:
                raise PricingError(f"price flag {spec!r} must look like MODEL=INPUT,CACHED_INPUT,OUTPUT")
            try:
                price = ModelPrice(*(float(p) for p in parts))
            except ValueError as e:
                raise PricingError(f"price flag {spec!r}: {e}") from e
            if name == "*":
                fallback = price
            else:
                models[name] = price
        return cls(models=MappingProxyType(models), fallback=fallback)

    def price_of(self, model: str) -> ModelPrice:
        """The model's row, else the default row, else free."""
        price = self.models.get(model)
        if price is not None:
            return price
        return self.fallback if self.fallback is not None else FREE

    def cost(self, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        """USD: ((prompt - cached) * input + cached * cached_input + completion * output) / 1e6."""
        return self.price_of(model).cost(prompt_tokens, cached_tokens, completion_tokens)


def _price_table(table: Any, where: str) -> ModelPrice:
    if not isinstance(table, Mapping):
        raise PricingError(f"{where} must be a table")
    unknown = set(table) - set(_PRICE_KEYS)
    if unknown:
        raise PricingError(f"{where}: unknown key(s) {sorted(unknown)}; expected {_PRICE_KEYS}")
    missing = [k for k in ("input", "output") if k not in table]
    if missing:
        raise PricingError(f"{where}: missing {missing}")
    try:
        return ModelPrice(table["input"], table.get("cached_input", table["input"]), table["output"])
    except PricingError as e:
        raise PricingError(f"{where}: {e}") from e
