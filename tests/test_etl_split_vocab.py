"""Patient-level splits by salted hash, and the vocabulary fitted on the train split only."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pandas as pd
import pytest
from conftest import EtlOutput

from behrt_rope import schema as S
from behrt_rope.etl.codes import fit_vocabulary, lookup
from behrt_rope.etl.config import SplitConfig
from behrt_rope.etl.split import assign_splits, patient_hash, shard_of

Run = Callable[..., EtlOutput]
IDS = np.array([f"P{i:06d}" for i in range(20_000)], dtype=object)


def _ids_in(split: str, n: int, config: SplitConfig | None = None) -> list[str]:
    splits = assign_splits(IDS[:2000], config or SplitConfig())
    return IDS[:2000][splits == split][:n].tolist()


# ---------------------------------------------------------------------------------------------------------
# Splits
# ---------------------------------------------------------------------------------------------------------
def test_split_shares_are_near_the_configured_fractions() -> None:
    for config in (SplitConfig(), SplitConfig(train=0.6, tuning=0.3, held_out=0.1)):
        splits = assign_splits(IDS, config)
        for name, share in zip(S.SPLITS, (config.train, config.tuning, config.held_out)):
            assert abs((splits == name).mean() - share) < 0.01, (name, share)


def test_split_depends_only_on_the_id() -> None:
    config = SplitConfig()
    whole = dict(zip(IDS, assign_splits(IDS, config)))
    rng = np.random.default_rng(0)
    subset = rng.permutation(IDS)[:500]
    assert assign_splits(subset, config).tolist() == [whole[i] for i in subset]
    assert assign_splits(IDS[:1], config).tolist() == [whole[IDS[0]]]


def test_salt_draws_a_different_split() -> None:
    a = assign_splits(IDS[:2000], SplitConfig())
    b = assign_splits(IDS[:2000], SplitConfig(salt="another"))
    assert (a != b).mean() > 0.2


def test_split_is_pinned_across_versions() -> None:
    """Golden values: a changed hash would silently move patients between the splits of existing datasets."""
    ids = np.array(["P000001", "P000002", "P000003", "P000004", "42"], dtype=object)
    assert assign_splits(ids, SplitConfig()).tolist() == ["train", "train", "tuning", "held_out", "train"]
    assert patient_hash(ids[:3], "split:behrt-rope").tolist() == [
        13033473843459132238,
        11174168913870926847,
        15839743421537771429,
    ]
    assert shard_of(ids, 3).tolist() == [1, 2, 0, 0, 0]


def test_degenerate_shares() -> None:
    assert set(assign_splits(IDS[:100], SplitConfig(train=1.0, tuning=0.0, held_out=0.0))) == {S.TRAIN}
    assert set(assign_splits(IDS[:100], SplitConfig(train=0.0, tuning=0.0, held_out=1.0))) == {S.HELD_OUT}
    with pytest.raises(ValueError, match="sum to 1"):
        SplitConfig(train=0.5, tuning=0.1, held_out=0.1)


def test_shards_are_independent_of_splits_and_cover_every_id() -> None:
    shards = shard_of(IDS, 4)
    assert set(shards.tolist()) == {0, 1, 2, 3}
    assert np.all(np.bincount(shards) > 4000)
    assert shard_of(IDS[::-1], 4).tolist() == shards[::-1].tolist()
    assert shard_of(IDS, 1).tolist() == [0] * len(IDS)
    train = assign_splits(IDS, SplitConfig()) == S.TRAIN
    assert abs(train[shards == 0].mean() - 0.8) < 0.03


def test_etl_splits_follow_assign_splits(etl_run: Run) -> None:
    ids = IDS[:40].tolist()
    patients = [{"patient_id": i, "birth_date": "2000-01-01"} for i in ids]
    events = [{"patient_id": i, "date": "2010-01-01", "code": "I10"} for i in ids]
    out = etl_run(patients, events)
    tokens = out.tokens
    expected = assign_splits(tokens[S.PATIENT_ID].to_numpy(dtype=object), SplitConfig())
    assert tokens[S.SPLIT].tolist() == expected.tolist()
    by_split = out.manifest["patients"]["by_split"]
    assert by_split == {s: int((tokens[S.SPLIT] == s).sum()) for s in S.SPLITS}


# ---------------------------------------------------------------------------------------------------------
# Vocabulary
# ---------------------------------------------------------------------------------------------------------
def test_vocabulary_is_fitted_on_train_only(etl_run: Run) -> None:
    train, held = _ids_in(S.TRAIN, 2), _ids_in(S.HELD_OUT, 1)
    patients = [{"patient_id": i, "birth_date": "2000-01-01"} for i in (*train, *held)]
    events = [
        {"patient_id": train[0], "date": "2010-01-01", "code": "I10"},
        {"patient_id": train[1], "date": "2010-01-01", "code": "I10"},
        {"patient_id": held[0], "date": "2010-01-01", "code": "I10"},
        {"patient_id": held[0], "date": "2010-01-01", "code": "Z99"},  # seen only in held_out
    ]
    out = etl_run(patients, events)
    vocab = out.vocab
    assert vocab["token"].tolist() == [*S.SPECIAL_TOKENS, "I10"]
    assert vocab.set_index("token").loc["I10", "train_count"] == 2
    assert out.token_strings(held[0]) == ["[CLS]", "[UNK]", "I10", "[SEP]"]
    shares = out.manifest["vocabulary"]["unk_share_by_split"]
    assert shares[S.HELD_OUT] == 0.5 and shares[S.TRAIN] == 0.0


def test_min_code_count_maps_rare_codes_to_unk(etl_run: Run) -> None:
    train = _ids_in(S.TRAIN, 3)
    patients = [{"patient_id": i, "birth_date": "2000-01-01"} for i in train]
    events = [{"patient_id": i, "date": "2010-01-01", "code": "I10"} for i in train]
    events += [
        {"patient_id": train[0], "date": "2011-01-01", "code": "RARE"},
        {"patient_id": train[0], "date": "2012-01-01", "code": "RARE"},
    ]  # two visits, count 2 < 3
    out = etl_run(patients, events, min_code_count=3)
    vocab = out.vocab.set_index("token")["train_count"]
    assert vocab.index.tolist() == [*S.SPECIAL_TOKENS, "I10"]
    assert vocab["[UNK]"] == 2 and vocab["I10"] == 3
    assert out.token_strings(train[0]) == ["[CLS]", "I10", "[SEP]", "[UNK]", "[SEP]", "[UNK]", "[SEP]"]
    assert out.manifest["vocabulary"]["train_codes_mapped_to_unk"] == 2


def test_vocab_file_schema_and_order() -> None:
    v = fit_vocabulary(pd.Series({"Z99": 3, "A00": 3, "M54": 1}), min_count=1)
    assert v["token"].tolist() == [*S.SPECIAL_TOKENS, "A00", "M54", "Z99"]
    assert v["token_id"].tolist() == list(range(len(v)))
    assert v.loc[S.UNK_ID, "train_count"] == 0


def test_raw_code_spelling_a_special_token_is_unk() -> None:
    v = fit_vocabulary(pd.Series({"[CLS]": 4, "I10": 1}), min_count=1)
    assert v["token"].tolist() == [*S.SPECIAL_TOKENS, "I10"]
    assert v.loc[S.UNK_ID, "train_count"] == 4
    ids = lookup(np.array(["[CLS]", "I10", "nope", "[PAD]"], dtype=object), v)
    assert ids.tolist() == [S.UNK_ID, S.N_SPECIAL, S.UNK_ID, S.UNK_ID]


def test_special_token_code_through_the_etl(etl_run: Run) -> None:
    train = _ids_in(S.TRAIN, 1)
    out = etl_run(
        [{"patient_id": train[0], "birth_date": "2000-01-01"}],
        [{"patient_id": train[0], "date": "2010-01-01", "code": "[SEP]"}],
    )
    assert out.token_strings(train[0]) == ["[CLS]", "[UNK]", "[SEP]"]
