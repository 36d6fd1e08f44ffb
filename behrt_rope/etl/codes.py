"""Code mapping: normalise raw codes into tokens, fit the vocabulary on the train split, look ids up."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from behrt_rope import schema as S
from behrt_rope.etl.config import EtlConfig


def factorize_text(
    values: pd.Series | np.ndarray | pd.api.extensions.ExtensionArray, sort: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """(int64 code per value, distinct values as an object array); missing values count as ''.

    ``sort=True``: the distinct values are sorted, so codes follow text order. ``sort=False`` is faster on
    columns with many distinct values (visit ids) and leaves them in no particular order.

    >>> codes, uniques = factorize_text(np.array(["b", "", "b", None], dtype=object))
    >>> codes.tolist(), uniques.tolist()
    ([1, 0, 1, 0], ['', 'b'])
    """
    arrow = _arrow_text(values)
    if arrow is not None:  # Arrow-backed text (pandas' default str dtype): hash in Arrow
        encoded = pc.dictionary_encode(arrow)
        uniques = np.asarray(encoded.dictionary.to_numpy(zero_copy_only=False), dtype=object)
        codes = np.asarray(pc.fill_null(encoded.indices, -1).to_numpy(zero_copy_only=False), dtype=np.int64)
    else:
        codes, found = pd.factorize(np.asarray(values, dtype=object))
        uniques = np.asarray(found, dtype=object)
    if (codes < 0).any():  # readers write '' for missing text; tolerate nulls all the same
        blank = np.flatnonzero(uniques == "")
        if not len(blank):
            uniques = np.append(uniques, "")
            blank = np.array([len(uniques) - 1])
        codes = np.where(codes < 0, blank[0], codes)
    if sort and len(uniques) > 1:
        order = np.argsort(uniques, kind="stable")
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))
        codes, uniques = rank[codes], uniques[order]
    return codes.astype(np.int64, copy=False), uniques


def _arrow_text(values: pd.Series | np.ndarray | pd.api.extensions.ExtensionArray) -> pa.Array | None:
    """The values as one Arrow string array when they are Arrow-backed already, else None."""
    if not isinstance(values, (pd.Series, pd.api.extensions.ExtensionArray)):
        return None
    dtype = values.dtype
    if isinstance(dtype, pd.StringDtype):
        arrow_backed = dtype.storage == "pyarrow"
    elif isinstance(dtype, pd.ArrowDtype):
        arrow_backed = pa.types.is_string(dtype.pyarrow_dtype) or pa.types.is_large_string(dtype.pyarrow_dtype)
    else:
        arrow_backed = False
    if not arrow_backed:
        return None
    array = pa.array(values)
    return array.combine_chunks() if isinstance(array, pa.ChunkedArray) else array


def pack_keys(columns: list[np.ndarray]) -> tuple[np.ndarray, int]:
    """One non-negative int64 key per row for the tuple of integer ``columns``, and its bound (key < bound).

    Equal tuples get equal keys and different tuples different keys. Each column is shifted to start at 0
    and divided by the gcd of its steps (dates in microseconds then take a day's room, not 86,400,000,000);
    when the product of the ranges would overflow, the key so far is factorized first.

    >>> key, bound = pack_keys([np.array([0, 1, 0, 0]), np.array([5, 5, 5, 6])])
    >>> key.tolist(), bound
    ([0, 2, 0, 1], 4)
    """
    n = len(columns[0]) if columns else 0
    if not n:
        return np.zeros(n, dtype=np.int64), 1
    packed = []
    for column in columns:
        shifted = _compact(column)
        packed.append((int(shifted.max()) + 1, shifted))
    packed.sort(key=lambda item: item[0])
    key, width = packed[0][1], packed[0][0]
    for span, column in packed[1:]:
        if width * span >= 1 << 62:  # compress before the product would overflow
            key, uniques = pd.factorize(key)
            width = len(uniques)
            if width * span >= 1 << 62:
                column, values = pd.factorize(column)
                span = len(values)
        key = key * span + column
        width *= span
    return key.astype(np.int64, copy=False), width


def _compact(column: np.ndarray) -> np.ndarray:
    """``(column - min) // gcd of the steps``: the same order and groups in the smallest range (int64).

    >>> _compact(np.array([86_400, 0, 172_800])).tolist()
    [1, 0, 2]
    """
    shifted = np.asarray(column, dtype=np.int64) - int(np.min(column))
    step = int(np.gcd.reduce(shifted[:1024]))  # the gcd of all divides that of a sample: try the sample's
    if step > 1 and not (shifted % step == 0).all():
        step = int(np.gcd.reduce(shifted))
    return shifted // step if step > 1 else shifted


def ordered_key(columns: list[np.ndarray]) -> np.ndarray | None:
    """One int64 key per row that sorts like the tuple of integer ``columns`` (the first most significant);
    None when the ranges are too wide to fit.

    >>> ordered_key([np.array([1, 0, 0]), np.array([10, 30, 20])]).tolist()
    [3, 2, 1]
    """
    n = len(columns[0]) if columns else 0
    key, width = np.zeros(n, dtype=np.int64), 1
    for column in columns:
        if not n:
            break
        shifted = _compact(column)
        span = int(shifted.max()) + 1
        if width * span >= 1 << 62:
            return None
        key, width = key * span + shifted, width * span
    return key


def group_ids(columns: list[np.ndarray]) -> np.ndarray:
    """A dense int64 group number per row for the tuple of integer ``columns`` (not in any particular order).

    >>> g = group_ids([np.array([0, 1, 0, 0]), np.array([5, 5, 5, 6])])
    >>> bool(g[0] == g[2]), len(set(g.tolist()))
    (True, 3)
    """
    return dense_ids(*pack_keys(columns))


def dense_ids(key: np.ndarray, width: int) -> np.ndarray:
    """Dense int64 numbers for non-negative int64 ``key`` < ``width``: by a lookup table when ``width`` is
    small (numbers then follow key order), else by hashing.

    >>> dense_ids(np.array([7, 3, 7, 0]), 8).tolist()
    [2, 1, 2, 0]
    """
    if width <= max(4 * len(key), 1 << 16):
        seen = np.zeros(width, dtype=bool)
        seen[key] = True
        return (np.cumsum(seen) - 1)[key]
    return pd.factorize(key)[0].astype(np.int64, copy=False)


def distinct_sorted(values: np.ndarray) -> np.ndarray:
    """The distinct values of a sorted array (``np.unique`` without its sort; numpy 2's hash path is slow).

    >>> distinct_sorted(np.array([1, 1, 2, 5, 5])).tolist()
    [1, 2, 5]
    """
    return values[np.r_[True, values[1:] != values[:-1]]] if len(values) else values


def repeated(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows whose int64 ``key`` occurs more than once: (their row numbers, a dense group number for each).

    Repeats are usually few: a bucket count (Fibonacci hashing into about 4 buckets per row) rules most
    rows out, and only the rest are sorted.

    >>> rows, group = repeated(np.array([5, 1, 5, 2, 1, 9]))
    >>> rows.tolist(), group.tolist()
    ([0, 1, 2, 4], [1, 0, 1, 0])
    """
    bits = max(int(4 * len(key)).bit_length(), 1)
    bucket = (key.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(64 - bits)
    bucket = bucket.astype(np.intp)
    maybe = np.flatnonzero(np.bincount(bucket, minlength=1 << bits)[bucket] > 1)
    if len(maybe) < 2:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    order = np.argsort(key[maybe])
    ordered = key[maybe][order]
    same = ordered[1:] == ordered[:-1]
    in_run = np.r_[same, False] | np.r_[False, same]
    rows, run_keys = maybe[order[in_run]], ordered[in_run]
    group = np.cumsum(np.r_[True, run_keys[1:] != run_keys[:-1]]) - 1 if len(rows) else rows
    back = np.argsort(rows, kind="stable")
    return rows[back].astype(np.int64), group[back].astype(np.int64)


def normalise_code(code: str, system: str, truncate: int | None, strip_dots: bool) -> str:
    """One raw code (and its code system) as a token string.

    Dots are removed when asked or when truncating (``E11.9`` -> ``E119`` -> ``E11`` at 3 characters);
    a non-empty system (vocabulary) is written before the code, MEDS style, so that vocabularies never
    collide (``ICD9CM/4589``).

    >>> normalise_code("E11.9", "", 3, False), normalise_code("E11.9", "", None, False)
    ('E11', 'E11.9')
    >>> normalise_code("4589", "ICD9CM", 3, True)
    'ICD9CM/458'
    """
    if strip_dots or truncate is not None:
        code = code.replace(".", "")
    if truncate is not None:
        code = code[:truncate]
    return f"{system}/{code}" if system else code


def tokens_of(codes: np.ndarray, systems: np.ndarray, config: EtlConfig) -> np.ndarray:
    """Vectorised :func:`normalise_code`: each distinct (code, system) pair is normalised once.

    >>> tokens_of(np.array(["I10", "I10.0", "E11"], dtype=object), np.array(["", "", ""], dtype=object),
    ...           EtlConfig(code_truncate=3)).tolist()
    ['I10', 'I10', 'E11']
    """
    return np.asarray(token_categorical(codes, systems, config), dtype=object)


def token_categorical(
    codes: np.ndarray | pd.Series, systems: np.ndarray | pd.Series, config: EtlConfig
) -> pd.Categorical:
    """Like :func:`tokens_of`, as a categorical whose categories (the distinct tokens) are sorted."""
    return token_codes(*factorize_text(codes), *factorize_text(systems), config)


def token_codes(
    code: np.ndarray, code_uniques: np.ndarray, system: np.ndarray, system_uniques: np.ndarray, config: EtlConfig
) -> pd.Categorical:
    """Tokens of factorized codes and systems (``code_uniques[code]``, ...) as a sorted categorical.

    >>> t = token_codes(np.array([0, 1, 2]), np.array(["I10", "I10.0", "E11"], dtype=object),
    ...                 np.array([0, 0, 0]), np.array([""], dtype=object), EtlConfig(code_truncate=3))
    >>> t.codes.tolist(), t.categories.tolist()
    ([1, 1, 0], ['E11', 'I10'])
    """
    n_codes = max(len(code_uniques), 1)
    key = np.asarray(system, dtype=np.int64) * n_codes + code
    pair = dense_ids(key, n_codes * max(len(system_uniques), 1))
    pair_uniques = np.zeros(int(pair.max()) + 1 if len(pair) else 0, dtype=np.int64)
    pair_uniques[pair] = key
    mapped = np.array(
        [
            normalise_code(
                str(code_uniques[p % n_codes]),
                str(system_uniques[p // n_codes]),
                config.code_truncate,
                config.strip_code_dots,
            )
            for p in pair_uniques
        ],
        dtype=object,
    )
    token_index, tokens = pd.factorize(mapped, sort=True)
    return pd.Categorical.from_codes(
        token_index[pair] if len(pair) else np.zeros(0, dtype=np.int64),
        categories=pd.Index(np.asarray(tokens, dtype=object), dtype=object),
    )


def fit_vocabulary(train_counts: pd.Series, min_count: int) -> pd.DataFrame:
    """Vocabulary table (S.VOCAB): special tokens first, then codes seen >= ``min_count`` times in train.

    Codes are ordered alphabetically, so ids do not depend on row order or on counts' ties.

    >>> v = fit_vocabulary(pd.Series({"I10": 5, "E11": 2, "Z99": 1}), min_count=2)
    >>> v["token"].tolist()
    ['[PAD]', '[CLS]', '[SEP]', '[MASK]', '[UNK]', 'E11', 'I10']
    >>> fit_vocabulary(pd.Series({"[MASK]": 3, "I10": 1}), min_count=1)["token"].tolist()[S.N_SPECIAL:]
    ['I10']
    """
    # a raw code spelling a special token (say "[MASK]") is never a code token: it counts as [UNK]
    is_code = (train_counts >= min_count) & ~train_counts.index.isin(S.SPECIAL_TOKENS)
    kept = train_counts[is_code].sort_index()
    tokens = list(S.SPECIAL_TOKENS) + kept.index.astype(str).tolist()
    counts = [0] * S.N_SPECIAL + kept.astype("int64").tolist()
    counts[S.UNK_ID] = int(train_counts[~is_code].sum())
    return pd.DataFrame({"token_id": np.arange(len(tokens), dtype=np.int32), "token": tokens, "train_count": counts})


def lookup(tokens: np.ndarray, vocabulary: pd.DataFrame) -> np.ndarray:
    """Token ids (int32) for token strings; tokens outside the vocabulary get [UNK].

    >>> v = fit_vocabulary(pd.Series({"I10": 1}), 1)
    >>> lookup(np.array(["I10", "E11"], dtype=object), v).tolist()
    [5, 4]
    """
    ids = pd.Index(vocabulary["token"]).get_indexer(tokens)
    ids[ids < S.N_SPECIAL] = S.UNK_ID  # unknown (-1), and raw codes that spell a special token
    return ids.astype(np.int32)
