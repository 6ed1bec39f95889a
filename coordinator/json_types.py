"""Request-model building blocks that read JSON the way the published spec (JSON Schema) does.

pydantic's default (lax) mode converts what JSON Schema refuses: ``true`` becomes 1, ``"5"``
becomes 5, ``1`` becomes ``true``; so a request the spec forbids would be served. Request models
therefore use :data:`STRICT` and declare integers as :data:`JsonInt`, which strict mode alone
would get wrong the other way: JSON Schema counts ``5.0`` as an integer, strict pydantic does
not.

An integer with constraints is ``Annotated[int, Field(ge=1), INTEGRAL]`` (optional: ``… | None``):
constraints given on the union, or after the validator, would not reach the spec as
``minimum``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, ConfigDict


def _integral_float_to_int(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


#: Request models: no coercion between JSON types, unknown fields refused.
STRICT = ConfigDict(strict=True, extra="forbid")
#: Reports from workers: no coercion either, but fields a newer worker adds are ignored.
STRICT_OPEN = ConfigDict(strict=True)

#: A JSON object as the API answers it and the state store keeps it (values of any JSON type).
JsonDoc = dict[str, Any]

#: Reads an integral float (``5.0``) as the integer JSON Schema says it is.
INTEGRAL = BeforeValidator(_integral_float_to_int)

JsonInt = Annotated[int, INTEGRAL]
