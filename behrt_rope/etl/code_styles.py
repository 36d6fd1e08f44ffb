"""Diagnosis code styles of MEDS datasets: which codes are diagnoses, and their ``VOCABULARY/code`` names.

A style is one entry of ``etl.meds.code_patterns``, written ``TEMPLATE=REGEX``: the regular expression (RE2)
selects codes and names their parts with groups; the template builds the vocabulary from the groups
(``ICD{version}CM``, ``{vocabulary}``). Styles are tried in order and the first that matches a code wins.
The vocabulary then goes through ``etl.meds.vocabulary_aliases`` (``SNOMED-CT=SNOMED``), so that one
vocabulary spelled two ways gives one token; different vocabularies (ICD-10 and ICD-10-CM) stay apart.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from behrt_rope.errors import UserError

CODE_GROUP = "code"
SETTING = "etl.meds.code_patterns"

# Diagnosis vocabularies as OMOP names them (vocabulary_id), plus spellings seen in MEDS exports.
DIAGNOSIS_VOCABULARIES = (
    "ICD10CM",
    "ICD9CM",
    "ICD10",
    "ICD9",
    "ICD10GM",
    "ICD10CA",
    "ICD10CN",
    "ICD11",
    "SNOMED",
    "SNOMED-CT",
    "SNOMEDCT",
    "SNOMEDCT_US",
)
_VOCABULARIES = "|".join(DIAGNOSIS_VOCABULARIES)
DEFAULT_CODE_PATTERNS = (
    # MIMIC-IV MEDS (MEDS-Transforms): DIAGNOSIS//ICD//10//I10; MIMIC codes are ICD-9-CM / ICD-10-CM
    r"ICD{version}CM=^DIAGNOSIS//ICD//(?P<version>9|10)//(?P<code>[^/]+)$",
    # event type, then vocabulary: DIAGNOSIS//ICD10CM//E11.9, CONDITION//SNOMED//44054006
    rf"{{vocabulary}}=^(?:DIAGNOSIS|CONDITION)//(?P<vocabulary>{_VOCABULARIES})//(?P<code>[^/]+)$",
    # vocabulary, double slash (Synthea-derived and MEDS-Transforms exports): SNOMED//44054006
    rf"{{vocabulary}}=^(?P<vocabulary>{_VOCABULARIES})//(?P<code>[^/]+)$",
    # vocabulary, single slash (meds_etl from OMOP, MEDS convention): ICD10CM/E11.9, SNOMED/44054006
    rf"{{vocabulary}}=^(?P<vocabulary>{_VOCABULARIES})/(?P<code>[^/]+)$",
)
DEFAULT_VOCABULARY_ALIASES = (
    "SNOMED-CT=SNOMED",
    "SNOMEDCT=SNOMED",
    "SNOMEDCT_US=SNOMED",
    "ICD-10-CM=ICD10CM",
    "ICD-9-CM=ICD9CM",
)


@dataclass(frozen=True)
class Style:
    """One parsed ``TEMPLATE=REGEX`` entry."""

    entry: str  # as configured, the key of its row count in the manifest
    template: str
    pattern: str
    groups: tuple[str, ...]  # named groups the template uses


def parse_styles(entries: list[str] | tuple[str, ...]) -> list[Style]:
    """Check and split ``etl.meds.code_patterns``; a bad entry stops with the setting and what to fix.

    >>> [(s.template, s.groups) for s in parse_styles([r"{vocabulary}=^(?P<vocabulary>SNOMED)//(?P<code>.+)$"])]
    [('{vocabulary}', ('vocabulary',))]
    >>> parse_styles([r"^SNOMED//(?P<code>.+)$"])
    Traceback (most recent call last):
    ...
    behrt_rope.errors.UserError: etl.meds.code_patterns entry '^SNOMED//(?P<code>.+)$' must be TEMPLATE=REGEX \
(for example SNOMED=^SNOMED//(?P<code>.+)$)
    """
    if not entries:
        raise UserError(f"{SETTING} is empty: give at least one TEMPLATE=REGEX (docs/formats.md)")
    return [_parse(entry) for entry in entries]


def _parse(entry: str) -> Style:
    template, sep, pattern = entry.partition("=")
    if not sep or not re.fullmatch(r"[\w.\-{}]*", template):
        raise UserError(f"{SETTING} entry {entry!r} must be TEMPLATE=REGEX (for example SNOMED=^SNOMED//(?P<code>.+)$)")
    try:
        groups = re.compile(pattern).groupindex
    except re.error as err:
        raise UserError(f"{SETTING} entry {entry!r}: {pattern!r} is not a regular expression: {err}") from err
    if CODE_GROUP not in groups:
        raise UserError(f"{SETTING} entry {entry!r} needs a named group (?P<code>...)")
    try:
        pc.extract_regex(pa.array([""]), pattern)
    except pa.ArrowInvalid as err:
        first = str(err).strip().splitlines()[0]
        raise UserError(f"{SETTING} entry {entry!r}: {first} (RE2 syntax; name every group or use (?:...))") from err
    used = tuple(name for _, name, _, _ in string.Formatter().parse(template) if name is not None)
    unknown = [name for name in used if name not in groups or name == CODE_GROUP]
    if unknown:
        raise UserError(f"{SETTING} entry {entry!r}: template fields {unknown} are not named groups of the pattern")
    return Style(entry, template, pattern, used)


def parse_aliases(entries: list[str] | tuple[str, ...]) -> dict[str, str]:
    """``["SNOMED-CT=SNOMED"]`` as a mapping; an entry without ``=`` stops.

    >>> parse_aliases(["SNOMED-CT=SNOMED"])
    {'SNOMED-CT': 'SNOMED'}
    """
    aliases = {}
    for entry in entries:
        name, sep, canonical = entry.partition("=")
        if not sep or not name or not canonical:
            raise UserError(f"etl.meds.vocabulary_aliases entry {entry!r} must be NAME=CANONICAL (SNOMED-CT=SNOMED)")
        aliases[name] = canonical
    return aliases


@dataclass
class Matches:
    """Which codes of an array are diagnoses (``style`` >= 0), with their code and vocabulary (text arrays)."""

    style: np.ndarray  # int64 per input code: index of the first matching style, -1 for none
    code: np.ndarray  # object, '' where no style matched
    vocabulary: np.ndarray  # object


def match(codes: pa.ChunkedArray | pa.Array, styles: list[Style], aliases: dict[str, str]) -> Matches:
    """Apply the styles to an Arrow string array, the first matching style per code. A code that no style
    matches as written is tried once more in upper case (``diagnosis//icd//10//e119`` reads as
    ``DIAGNOSIS//ICD//10//E119``: some exports lower-case their codes), so codes that match as written keep
    their tokens.

    The regular expressions run once per distinct code (an event table repeats a few thousand codes).

    >>> m = match(pa.array(["SNOMED//1", "LAB//2", "DIAGNOSIS//ICD//9//250", "diagnosis//icd//10//e119"]),
    ...           parse_styles(list(DEFAULT_CODE_PATTERNS)), {})
    >>> m.style.tolist(), m.code.tolist(), m.vocabulary.tolist()
    ([2, -1, 0, 0], ['1', '', '250', 'E119'], ['SNOMED', '', 'ICD9CM', 'ICD10CM'])
    """
    distinct, index = _distinct(codes)
    found = _match_distinct(distinct, styles, aliases)
    missed = np.flatnonzero(found.style < 0)
    if len(missed):
        again = _match_distinct(pc.utf8_upper(distinct.take(pa.array(missed))), styles, aliases)
        for field in ("style", "code", "vocabulary"):
            getattr(found, field)[missed] = getattr(again, field)
    return Matches(found.style[index], found.code[index], found.vocabulary[index])


def _distinct(codes: pa.ChunkedArray | pa.Array) -> tuple[pa.Array, np.ndarray]:
    """(distinct codes, with a null last; int64 position of each code among them)."""
    if isinstance(codes, pa.ChunkedArray):
        codes = codes.combine_chunks()
    encoded = pc.dictionary_encode(codes)
    distinct = pa.concat_arrays([encoded.dictionary.cast(pa.string()), pa.nulls(1, pa.string())])
    index = pc.fill_null(encoded.indices, len(distinct) - 1).to_numpy(zero_copy_only=False)
    return distinct, np.asarray(index, dtype=np.int64)


def _match_distinct(codes: pa.Array, styles: list[Style], aliases: dict[str, str]) -> Matches:
    n = len(codes)
    style = np.full(n, -1, dtype=np.int64)
    code = np.full(n, "", dtype=object)
    vocabulary = np.full(n, "", dtype=object)
    for i, s in enumerate(styles):
        todo = np.flatnonzero(style < 0)
        if not len(todo):
            break
        parts = pc.extract_regex(codes if len(todo) == n else codes.take(pa.array(todo)), s.pattern)
        hit = np.asarray(pc.is_valid(parts).to_numpy(zero_copy_only=False), dtype=bool)
        if not hit.any():
            continue
        found = parts.filter(pa.array(hit))
        rows = todo[hit]
        style[rows] = i
        code[rows] = _text(pc.struct_field(found, CODE_GROUP))
        vocabulary[rows] = _vocabularies(found, s, aliases)
    return Matches(style, code, vocabulary)


def _vocabularies(found: pa.Array, style: Style, aliases: dict[str, str]) -> np.ndarray:
    """The template filled per match, once per distinct group tuple, then aliased."""
    if not style.groups:
        value = aliases.get(style.template, style.template)
        return np.full(len(found), value, dtype=object)
    columns = [pc.fill_null(pc.struct_field(found, g), "") for g in style.groups]
    encoded = pc.dictionary_encode(pc.binary_join_element_wise(*columns, "\x1f"))
    filled = []
    for key in encoded.dictionary.to_pylist():
        value = style.template.format(**dict(zip(style.groups, str(key).split("\x1f"))))
        filled.append(aliases.get(value, value))
    return np.asarray(filled, dtype=object)[encoded.indices.to_numpy(zero_copy_only=False)]


def _text(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return np.asarray(pc.fill_null(array, "").to_numpy(zero_copy_only=False), dtype=object)


def prefix_counts(codes: pa.Array | pa.ChunkedArray) -> dict[str, int]:
    """How many codes have each :func:`code_prefix` (nulls not counted).

    >>> prefix_counts(pa.array(["LAB//1", "LAB//2", "SNOMED//3", None]))
    {'LAB//': 2, 'SNOMED//': 1}
    """
    distinct, index = _distinct(codes)
    counts = np.bincount(index, minlength=len(distinct))[:-1]
    prefixes = np.asarray(code_prefix(distinct[:-1]).to_numpy(zero_copy_only=False), dtype=object)
    total: dict[str, int] = {}
    for prefix, n in zip(prefixes, counts):
        if n:
            total[prefix] = total.get(prefix, 0) + int(n)
    return total


def code_prefix(codes: pa.Array | pa.ChunkedArray) -> pa.Array:
    """The prefix a person would recognise a code style by: up to and including the first run of slashes
    (``SNOMED//``, ``ICD10CM/``), else the whole code cut to 24 characters.

    >>> code_prefix(pa.array(["SNOMED//44054006", "ICD10CM/E11.9", "MEDS_BIRTH"])).to_pylist()
    ['SNOMED//', 'ICD10CM/', 'MEDS_BIRTH']
    """
    head = pc.extract_regex(codes, r"^(?P<p>[^/]*/+)")
    whole = pc.utf8_slice_codeunits(codes, 0, 24)
    return pc.coalesce(pc.struct_field(head, "p"), whole)
