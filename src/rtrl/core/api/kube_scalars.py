"""Plain YAML scalars as Kubernetes reads them: the resolution rules of goyaml.v2, the YAML
library of kubectl and the API server (through sigs.k8s.io/yaml), which are not PyYAML's.

``y``, ``on`` and ``off`` are booleans; ``0x1F``, ``0o17``, ``0b101`` and ``017`` integers
in Go's syntax (``08`` is then the float 8); ``1e-6`` is a float without a dot; ``1:30`` is
a string (no sexagesimal numbers). A date or time stays the string it is written as
(sigs.k8s.io/yaml keeps timestamps as strings), and so does a float too large for a double
(Go's ParseFloat fails on it). Tested on the real API server (tests/e2e).
"""

from __future__ import annotations

import math
import re
from typing import Any

TAG = "tag:yaml.org,2002:"

_TRUE = {"y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"}
_FALSE = {"n", "N", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"}
_NULLS = {"", "~", "null", "Null", "NULL"}
_SPECIAL = {f"{s}.{w}": float(f"{s}inf") for s in ("", "+", "-") for w in ("inf", "Inf", "INF")}
_SPECIAL |= {f".{w}": math.nan for w in ("nan", "NaN", "NAN")}
_GO_INT = re.compile(r"[-+]?(0[bB][01]+|0[oO][0-7]+|0[xX][0-9a-fA-F]+|0[0-7]*|[1-9][0-9]*)")
_GO_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_BASES = {"b": 2, "o": 8, "x": 16}


def resolve(text: str) -> tuple[str, Any]:
    """The tag (``TAG`` + ``str``, ``null``, ``bool``, ``int`` or ``float``) and the value
    of a plain (unquoted, untagged) scalar. Integers are not range-checked here."""
    if text in _NULLS:
        return TAG + "null", None
    if text in _TRUE or text in _FALSE:
        return TAG + "bool", text in _TRUE
    if text in _SPECIAL:
        return TAG + "float", _SPECIAL[text]
    if not text or text[0] not in "+-.0123456789":
        return TAG + "str", text
    plain = text.replace("_", "")
    if _GO_INT.fullmatch(plain):
        digits = plain.lstrip("+-")
        if digits[:2].lower() in ("0b", "0o", "0x"):
            number = int(digits[2:], _BASES[digits[1].lower()])
        else:  # a leading 0 is octal in Go's syntax
            number = int(digits, 8 if digits[0] == "0" and len(digits) > 1 else 10)
        return TAG + "int", -number if plain.startswith("-") else number
    if _GO_FLOAT.fullmatch(plain) and math.isfinite(float(plain)):
        return TAG + "float", float(plain)
    return TAG + "str", text
