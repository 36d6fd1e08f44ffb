"""Codes a model never saw that are in its vocabulary under another spelling (``predict``'s ``match_codes``).

Two spellings often differ between the data a model was trained on and the data it scores. The vocabulary
prefix: MEDS and OMOP name codes ``ICD10CM/E119`` while the visits format without ``code_system`` gives
``E119``. And the case: ``e119`` for ``E119``. ``predict`` never re-spells a code unasked (some code systems
are case-sensitive, such as Read codes, and one bare code can belong to two vocabularies). It counts the
unknown code events each remedy would match, and applies the remedies named in ``match_codes``. A spelling
that two vocabulary tokens share (``ICD10/E119`` and ``ICD10CM/E119`` for ``E119``) matches neither.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from typing import Literal

import numpy as np
import pandas as pd

from behrt_rope import schema as S

Remedy = Literal["vocabulary_prefix", "case"]
REMEDIES: tuple[Remedy, ...] = ("vocabulary_prefix", "case")
SETTING = "match_codes"
_PREFIXED = re.compile(r"[A-Za-z][\w\-]*/(?P<bare>[^/].*)")  # VOCABULARY/CODE, as MEDS names codes


def bare(token: str) -> str:
    """``token`` without its ``VOCABULARY/`` prefix ('' when it has none).

    >>> bare("ICD10CM/E119"), bare("E119"), bare("SNOMED//1")
    ('E119', '', '')
    """
    found = _PREFIXED.fullmatch(token)
    return found["bare"] if found else ""


class Matcher:
    """Finds the vocabulary token an unknown token is a respelling of, under a set of remedies.

    >>> m = Matcher(["[UNK]", "E119", "ICD10CM/I10", "ICD9/I10X", "ICD10/I10X"], ["vocabulary_prefix"])
    >>> m("ICD10CM/E119"), m("I10"), m("I10X"), m("e119")
    ('E119', 'ICD10CM/I10', None, None)
    >>> Matcher(["E119", "G30..", "g30.."], ["case"])("e119"), Matcher(["G30..", "g30.."], ["case"])("G30..")
    ('E119', None)
    """

    def __init__(self, vocabulary: Iterable[str], remedies: Iterable[str]) -> None:
        self.remedies = frozenset(remedies)
        tokens = [t for t in vocabulary if t not in S.SPECIAL_TOKENS]
        self.known = frozenset(tokens)
        self._spelled = _unique((self._key(t), t) for t in tokens)
        self._by_bare = _unique((self._key(bare(t)), t) for t in tokens if bare(t))

    def _key(self, token: str) -> str:
        return token.upper() if "case" in self.remedies else token

    def __call__(self, token: str) -> str | None:
        """The vocabulary token ``token`` matches, or None (a known token matches nothing: it needs none)."""
        if token in self.known:
            return None
        found = self._spelled.get(self._key(token))
        if found is None and "vocabulary_prefix" in self.remedies:
            stripped = bare(token)
            found = self._spelled.get(self._key(stripped)) if stripped else self._by_bare.get(self._key(token))
        return found


def _unique(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """``{key: token}`` for the keys that exactly one token has."""
    tokens: dict[str, set[str]] = {}
    for key, token in pairs:
        tokens.setdefault(key, set()).add(token)
    return {key: next(iter(found)) for key, found in tokens.items() if len(found) == 1}


def respell(tokens: pd.Categorical, matcher: Matcher) -> tuple[pd.Categorical, Counter[str]]:
    """``tokens`` with every category the matcher matches replaced by its vocabulary token (categories stay
    sorted and distinct), and the occurrences of each replaced token.

    >>> t, n = respell(pd.Categorical(["e119", "I10", "e119"]), Matcher(["E119", "I10"], ["case"]))
    >>> t.tolist(), t.categories.tolist(), n
    (['E119', 'I10', 'E119'], ['E119', 'I10'], Counter({'e119': 2}))
    """
    categories = np.asarray(tokens.categories, dtype=object)
    found = [matcher(str(c)) for c in categories]
    if not any(found):
        return tokens, Counter()
    spelled = np.asarray([f or c for f, c in zip(found, categories)], dtype=object)
    index, distinct = pd.factorize(spelled, sort=True)
    codes = np.asarray(tokens.codes)
    counts = np.bincount(codes[codes >= 0], minlength=len(categories))
    matched = Counter({str(categories[i]): int(counts[i]) for i, f in enumerate(found) if f and counts[i]})
    respelled = pd.Categorical.from_codes(
        np.where(codes >= 0, index[codes], -1), categories=pd.Index(np.asarray(distinct, dtype=object), dtype=object)
    )
    return respelled, matched


def would_match(unknown: Counter[str], vocabulary: Iterable[str], applied: Iterable[Remedy]) -> dict[str, int]:
    """Events of the ``unknown`` tokens that more remedies would match, keyed by the ``match_codes`` value
    that would (``applied`` ones included), the fewest remedies first.

    >>> would_match(Counter({"e119": 3, "ICD10CM/I10": 2, "Z99": 1}), ["E119", "I10"], [])
    {'vocabulary_prefix': 2, 'case': 3}
    """
    applied = frozenset(applied)
    options = [frozenset(o) for o in (("vocabulary_prefix",), ("case",), REMEDIES)]
    matchers = {o | applied: Matcher(vocabulary, o | applied) for o in options if not o <= applied}
    counts: dict[str, int] = {}
    for token, n in unknown.items():
        for remedies, matcher in matchers.items():
            if matcher(token) is not None:
                key = setting_value(remedies)
                counts[key] = counts.get(key, 0) + n
                break
    return {setting_value(r): counts[setting_value(r)] for r in matchers if setting_value(r) in counts}


def setting_value(remedies: Iterable[str]) -> str:
    """The ``match_codes`` value for ``remedies``, in :data:`REMEDIES` order.

    >>> setting_value({"case", "vocabulary_prefix"})
    'vocabulary_prefix,case'
    """
    return ",".join(r for r in REMEDIES if r in set(remedies))
