"""Code mapping: normalise raw codes into tokens, fit the vocabulary on the train split, look ids up."""

from __future__ import annotations

import numpy as np
import pandas as pd

from behrt_rope import schema as S
from behrt_rope.etl.config import EtlConfig


def normalise_code(code: str, system: str, truncate: int | None, strip_dots: bool) -> str:
    """One raw code (and its code system) as a token string.

    Dots are removed when asked or when truncating (``E11.9`` -> ``E119`` -> ``E11`` at 3 characters);
    a non-empty system is written before the code so that systems never collide (``ICD9:4589``).

    >>> normalise_code("E11.9", "", 3, False), normalise_code("E11.9", "", None, False)
    ('E11', 'E11.9')
    >>> normalise_code("4589", "ICD9", 3, True)
    'ICD9:458'
    """
    if strip_dots or truncate is not None:
        code = code.replace(".", "")
    if truncate is not None:
        code = code[:truncate]
    return f"{system}:{code}" if system else code


def tokens_of(codes: np.ndarray, systems: np.ndarray, config: EtlConfig) -> np.ndarray:
    """Vectorised :func:`normalise_code`: each distinct (code, system) pair is normalised once.

    >>> tokens_of(np.array(["I10", "I10.0", "E11"], dtype=object), np.array(["", "", ""], dtype=object),
    ...           EtlConfig(code_truncate=3)).tolist()
    ['I10', 'I10', 'E11']
    """
    pairs = pd.MultiIndex.from_arrays([codes, systems])
    index, uniques = pd.factorize(pairs)
    mapped = np.array(
        [normalise_code(c, s, config.code_truncate, config.strip_code_dots) for c, s in uniques],
        dtype=object,
    )
    return mapped[index] if len(mapped) else np.array([], dtype=object)


def fit_vocabulary(train_counts: pd.Series, min_count: int) -> pd.DataFrame:
    """Vocabulary table (S.VOCAB): special tokens first, then codes seen >= ``min_count`` times in train.

    Codes are ordered alphabetically, so ids do not depend on row order or on counts' ties.

    >>> v = fit_vocabulary(pd.Series({"I10": 5, "E11": 2, "Z99": 1}), min_count=2)
    >>> v["token"].tolist()
    ['[PAD]', '[CLS]', '[SEP]', '[MASK]', '[UNK]', 'E11', 'I10']
    """
    kept = train_counts[train_counts >= min_count].sort_index()
    tokens = list(S.SPECIAL_TOKENS) + kept.index.astype(str).tolist()
    counts = [0] * S.N_SPECIAL + kept.astype("int64").tolist()
    counts[S.UNK_ID] = int(train_counts[train_counts < min_count].sum())
    return pd.DataFrame(
        {"token_id": np.arange(len(tokens), dtype=np.int32), "token": tokens, "train_count": counts}
    )


def lookup(tokens: np.ndarray, vocabulary: pd.DataFrame) -> np.ndarray:
    """Token ids (int32) for token strings; tokens outside the vocabulary get [UNK].

    >>> v = fit_vocabulary(pd.Series({"I10": 1}), 1)
    >>> lookup(np.array(["I10", "E11"], dtype=object), v).tolist()
    [5, 4]
    """
    ids = pd.Index(vocabulary["token"]).get_indexer(tokens)
    ids[ids < S.N_SPECIAL] = S.UNK_ID  # unknown (-1), and raw codes that spell a special token
    return ids.astype(np.int32)
