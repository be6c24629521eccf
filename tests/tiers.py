"""Matrices that CI runs one case of per kind of path.

A compile or interpreter test parametrised over every architecture (or family, or quant
format) costs a compile or an interpreter run per value, and each new family would add one to
CI. ``matrix`` keeps every value in the parametrisation but marks those outside ``ci`` with
``full``: the conftest deselects them unless ``LOCALLLM_FULL_MATRIX=1`` (or ``-m full``). Pick
for ``ci`` one value per kind of path the test guards (e.g. a tied head and an untied one),
not one per architecture.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest
from _pytest.mark.structures import ParameterSet


def matrix(values: Iterable[object], ci: Sequence[object]) -> list[ParameterSet]:
    """``values`` as ``pytest.param``s, those not in ``ci`` marked ``full``. Every ``ci`` value
    must be one of ``values``: a typo would silently drop the case CI is meant to run."""
    values = list(values)
    missing = [v for v in ci if v not in values]
    if missing:
        raise ValueError(f"matrix: CI cases {missing} are not among the values {values}")
    # a tuple is one case of several argnames ("arch, dtype")
    return [pytest.param(*v if isinstance(v, tuple) else (v,), marks=() if v in ci else pytest.mark.full)
            for v in values]
