"""Human-readable names of code tokens (``code_descriptions.parquet``), from what the input carries.

Readers hand over (code, vocabulary, description) rows: MEDS from ``metadata/codes.parquet``, OMOP from the
``concept`` table's ``concept_name``. They are named like events (:func:`~behrt_rope.etl.codes.token_codes`)
and kept for the vocabulary's tokens only, so the report can print ``ICD10CM/E11 Type 2 diabetes mellitus``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from behrt_rope import schema as S
from behrt_rope.etl.codes import factorize_text, token_codes
from behrt_rope.etl.config import EtlConfig


def token_descriptions(frames: list[pd.DataFrame | None], config: EtlConfig, vocabulary: pd.DataFrame) -> pd.DataFrame:
    """One description per vocabulary token (S.CODE_DESCRIPTIONS columns), from raw (CODE, CODE_SYSTEM,
    DESCRIPTION) rows.

    Several raw codes can give one token (dots stripped, codes truncated): the shortest raw code names it,
    so ``E11`` (the category) wins over ``E11.9``.

    >>> raw = pd.DataFrame({S.CODE: ["E11.9", "E11", "I10"], S.CODE_SYSTEM: ["ICD10CM"] * 3,
    ...                     S.DESCRIPTION: ["T2DM without complications", "Type 2 diabetes mellitus", "HTN"]})
    >>> vocab = pd.DataFrame({S.TOKEN: ["[PAD]", "ICD10CM/E11"]})
    >>> token_descriptions([raw], EtlConfig(code_truncate=3), vocab).values.tolist()
    [['ICD10CM/E11', 'Type 2 diabetes mellitus']]
    """
    frames = [f for f in frames if f is not None and len(f)]
    if not frames:
        return pd.DataFrame({S.TOKEN: pd.Series(dtype=object), S.DESCRIPTION: pd.Series(dtype=object)})
    raw = pd.concat(frames, ignore_index=True)
    tokens = token_codes(*factorize_text(raw[S.CODE]), *factorize_text(raw[S.CODE_SYSTEM]), config)
    frame = pd.DataFrame(
        {
            S.TOKEN: np.asarray(tokens, dtype=object),
            S.DESCRIPTION: raw[S.DESCRIPTION].astype(str).str.strip().to_numpy(dtype=object),
            "length": raw[S.CODE].astype(str).str.len().to_numpy(),
            "code": raw[S.CODE].astype(str).to_numpy(dtype=object),
        }
    )
    frame = frame[(frame[S.DESCRIPTION] != "") & frame[S.TOKEN].isin(vocabulary[S.TOKEN])]
    frame = frame[~frame[S.TOKEN].isin(S.SPECIAL_TOKENS)]
    frame = frame.sort_values([S.TOKEN, "length", "code"], kind="stable").drop_duplicates(S.TOKEN)
    return frame[[S.TOKEN, S.DESCRIPTION]].reset_index(drop=True)


def write(descriptions: pd.DataFrame, path: Path) -> None:
    """Write the table (S.CODE_DESCRIPTIONS), even when empty, so every ETL output has the same files."""
    table = pa.Table.from_pandas(descriptions, schema=S.CODE_DESCRIPTIONS, preserve_index=False)
    pq.write_table(table, path)


def load(etl_dir: str | Path) -> dict[str, str]:
    """token -> description from an ETL output directory; empty when it has none."""
    path = Path(etl_dir) / S.CODE_DESCRIPTIONS_FILE
    if not path.is_file():
        return {}
    table = pq.read_table(path, columns=[S.TOKEN, S.DESCRIPTION])
    return dict(zip(table[S.TOKEN].to_pylist(), table[S.DESCRIPTION].to_pylist()))
