"""Numbers read from configuration (the environment, the policy file, the cluster's ConfigMap, a
cluster spec): finite, and never a true or false standing in for one.

Pydantic alone takes ``nan`` and ``inf`` for a float and ``true`` for 1. Each field still sets its
own bounds (``Field(ge=..., le=...)``): a duration is never negative nor absurdly long.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BeforeValidator, Field


def _not_bool(value: object) -> object:
    if isinstance(value, bool):
        raise ValueError(f"a number, not {str(value).lower()}")
    return value


# A float that is a number: not nan, inf or -inf (written as such in YAML, JSON or a variable).
Finite = Annotated[float, Field(allow_inf_nan=False), BeforeValidator(_not_bool)]
# A whole number (nan and inf are refused as floats already).
Whole = Annotated[int, BeforeValidator(_not_bool)]
