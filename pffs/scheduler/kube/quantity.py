"""Kubernetes resource quantities ("4", "500m", "16Gi", "1e3") as exact numbers."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from pffs.scheduler.kube.json_fields import BadObject

MIB = 2**20


_QUANTITY = re.compile(
    r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"  # the number
    r"(?:(Ki|Mi|Gi|Ti|Pi|Ei)|([numkMGTPE])|[eE]([+-]?[0-9]+))?"  # binary SI, decimal SI, or exponent
)
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def parse_quantity(text: str) -> Fraction:
    """A Kubernetes resource quantity ("4", "500m", "16Gi", "1e3", "1.5G") as an exact number.

    The grammar of k8s.io/apimachinery's resource.Quantity: a signed decimal, then one binary-SI suffix
    (Ki..Ei), one decimal-SI suffix (n u m "" k M G T P E; "E" is exa) or a decimal exponent (e3, E-2).
    """
    if not isinstance(text, str):
        raise BadObject(f"quantity {text!r} must be a string")
    match = _QUANTITY.fullmatch(text.strip())
    if match is None or not text.strip():
        raise BadObject(f"{text!r} is not a Kubernetes quantity (examples: 4, 500m, 16Gi, 1e3)")
    number, binary, decimal, exponent = match.groups()
    if len(number) > 40:  # Fraction(str) of thousands of digits raises ValueError (int digits limit)
        raise BadObject(f"{text[:50]!r}...: too many digits for a quantity")
    value = Fraction(number)
    if binary:
        return value * 2 ** _BINARY[binary]
    power = _DECIMAL[decimal] if decimal else int(exponent) if exponent else 0
    if abs(power) > 30:  # keeps the arithmetic small; far beyond anything a cluster holds
        raise BadObject(f"{text!r}: exponent out of range")
    return value * Fraction(10) ** power


def amount(value: Any, what: str) -> Fraction:
    """``value`` as a quantity, or BadObject that names ``what``."""
    try:
        return parse_quantity(value)
    except BadObject as exc:
        raise BadObject(f"{what}: {exc}") from None
