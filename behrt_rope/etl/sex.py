"""A patient's recorded sex, read from the many spellings sources use, as one of four categories.

Sources spell it differently: ``F``/``M`` (MIMIC, Synthea), ``female``/``male``, HL7 administrative gender
(``F``, ``M``, ``O``, ``U``, ``A``, ``N``), ISO/IEC 5218 digits (``0`` not known, ``1`` male, ``2`` female,
``9`` not applicable) and OMOP gender concept ids (``8532`` female, ``8507`` male, ``8551`` unknown, ``8521``
other, ``8570`` ambiguous, ``0`` no matching concept). :func:`normalise_sex` maps all of them, case and
surrounding blanks ignored, to ``female``, ``male``, ``other`` or ``unknown``; a value it does not know becomes
``other`` (so the model still tells it apart from female, male and missing) and is reported in the manifest
(:func:`unrecognised_values`).

The model reads the category as an id (:data:`SEX_IDS`): ``unknown`` is 0, which embeds to zero, so a patient
whose sex is not recorded, and a source without a sex column, give the model no sex signal at all.
"""

from __future__ import annotations

from collections import Counter
from typing import Final

import numpy as np
import pandas as pd

from behrt_rope.schema import SEX_VALUES

UNKNOWN, FEMALE, MALE, OTHER = SEX_VALUES  # the categories, in id order
SEX_IDS: Final = {name: i for i, name in enumerate(SEX_VALUES)}
"""Category -> model input id; ``unknown`` is 0 (the embedding's zero row)."""

_SPELLINGS: Final = {
    FEMALE: ("f", "female", "woman", "w", "girl", "2", "8532", "gender//f", "sex//f"),
    MALE: ("m", "male", "man", "boy", "1", "8507", "gender//m", "sex//m"),
    OTHER: ("o", "other", "a", "ambiguous", "intersex", "x", "nonbinary", "non-binary", "diverse", "8521", "8570"),
    UNKNOWN: ("", "u", "unk", "unknown", "not known", "n", "na", "n/a", "nan", "none", "null", "not applicable",
              "not recorded", "not stated", "undetermined", "0", "9", "8551", "8551.0", "no matching concept"),
}  # fmt: skip
_CATEGORY_OF: Final = {spelling: category for category, names in _SPELLINGS.items() for spelling in names}


def _keys(values: object) -> np.ndarray:
    """Lower-cased, stripped text of each value (missing: ''), as an object array."""
    text = pd.Series(values, dtype=object).fillna("").astype(str).str.strip().str.lower()
    text = text.str.replace(r"\.0$", "", regex=True)  # ids read as floats: 8532.0
    return text.to_numpy(dtype=object)


def normalise_sex(values: object) -> np.ndarray:
    """``female``/``male``/``other``/``unknown`` for each raw value (object array of the same length).

    >>> normalise_sex(["F", " male ", "8507", None, "", "U", "Diverse", "W", "2"]).tolist()
    ['female', 'male', 'male', 'unknown', 'unknown', 'unknown', 'other', 'female', 'female']
    """
    return pd.Series(_keys(values), dtype=object).map(_CATEGORY_OF).fillna(OTHER).to_numpy(dtype=object)


def unrecognised_values(values: object, limit: int = 5) -> dict[str, int]:
    """The raw values (as written) that :func:`normalise_sex` does not know, most frequent first, with counts.

    >>> unrecognised_values(["F", "X1", "X1", "Q"])
    {'X1': 2, 'Q': 1}
    """
    raw = pd.Series(values, dtype=object).fillna("").astype(str).to_numpy(dtype=object)
    unknown = [value for value, key in zip(raw, _keys(raw), strict=True) if key not in _CATEGORY_OF]
    return dict(Counter(unknown).most_common(limit))


def sex_ids(categories: object) -> np.ndarray:
    """int8 model ids of category names (anything not a category, e.g. None, is ``unknown``: 0).

    >>> sex_ids(["female", "male", "other", "unknown", None]).tolist()
    [1, 2, 3, 0, 0]
    """
    names = pd.Series(categories, dtype=object)
    return names.map(SEX_IDS).fillna(0).to_numpy(dtype=np.int8)
