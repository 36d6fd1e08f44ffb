"""Model files and checkpoints that cannot run code (issue 11, item 1).

Every test plants a pickle whose payload would create a file (:class:`Payload`) where a model file or a
checkpoint is expected, and checks that the command refuses it with a one-line message and that the file
was never created. Loading with ``pickle``/``torch.load(weights_only=False)`` would create it.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import safetensors.torch
import torch
from fixtures_training import FAST_TRAINER, TINY_MODEL, build_etl, error_line, pretrain_argv

from behrt_rope import schema as S
from behrt_rope.cli import main
from behrt_rope.errors import ArtifactError
from behrt_rope.model import ModelConfig
from behrt_rope.model.heads import BehrtForMultiLabel
from behrt_rope.training.bundle import load_bundle, save_bundle
from behrt_rope.training.checkpoints import load_checkpoint
from behrt_rope.training.inference import multilabel_model

FINETUNE = ("--max-epochs", "1", "task.min_label_count=2", *TINY_MODEL, *FAST_TRAINER)


class Payload:
    """Unpickling this calls ``open(target, "w")``: the file appears if, and only if, the pickle is run."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return open, (str(self.target), "w")


def plant_torch_pickle(path: Path, target: Path) -> None:
    """A ``torch.save`` file (zip + pickle) holding a state-dict-like dict with the payload inside."""
    torch.save({"state_dict": {"w": torch.zeros(2)}, "extra": Payload(target)}, path)


def plant_plain_pickle(path: Path, target: Path) -> None:
    path.write_bytes(pickle.dumps({"state_dict": Payload(target)}))


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    return error_line(capsys.readouterr().err)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny pre-trained and fine-tuned model on a tiny cohort (with its raw input)."""
    root = tmp_path_factory.mktemp("safe_loading")
    etl = build_etl(root, patients=120, seed=1)
    pre, ft = root / "pre", root / "ft"
    assert main(pretrain_argv(etl, pre, "trainer.batch_size=16")) == 0
    assert main(["finetune", "--data", str(etl), "--out", str(ft), "--pretrained", str(pre), *FINETUNE]) == 0
    return {"etl": etl, "raw": root / "raw", "pre": pre, "ft": ft}


def copy_of(folder: Path, dest: Path) -> Path:
    """A copy of a model directory (files only; the tests then damage the copy)."""
    dest.mkdir(parents=True)
    for f in folder.iterdir():
        if f.is_file():
            (dest / f.name).write_bytes(f.read_bytes())
    return dest


# ---------------------------------------------------------------------------------------------------------
# the model files: tensors + JSON only
# ---------------------------------------------------------------------------------------------------------
def test_model_directory_holds_only_safetensors_and_json(trained: dict[str, Path]) -> None:
    ft = trained["ft"]
    assert not (ft / S.LEGACY_MODEL_FILE).exists()
    meta = json.loads((ft / S.MODEL_META_FILE).read_text())
    assert meta["format"] == "behrt-rope-model" and meta["kind"] == "multilabel"
    assert meta["labels"] and meta["vocab"] and meta["etl_settings"] and meta["task"]
    weights = safetensors.torch.load_file(str(ft / S.MODEL_WEIGHTS_FILE))
    assert weights.keys() == load_bundle(ft, "multilabel")["state_dict"].keys()
    assert all(isinstance(v, torch.Tensor) for v in weights.values())


def test_bundle_round_trips_every_model_config_field(tmp_path: Path) -> None:
    """The configuration is saved field by field (dataclasses.asdict), so new fields flow through untouched."""
    config = ModelConfig(vocab_size=50, hidden_size=24, num_layers=2, num_heads=3, intermediate_size=40)
    state = {"a.weight": torch.randn(3, 4), "b.bias": torch.arange(5, dtype=torch.int64)}
    save_bundle(tmp_path, "mlm", config, state, vocabulary=["[PAD]", "E11"])
    (tmp_path / S.DONE_MARKER).write_text("pretrain\n")
    loaded = load_bundle(tmp_path, "mlm")
    assert dataclasses.asdict(loaded["model_config"]) == dataclasses.asdict(config)
    assert loaded["vocabulary"] == ["[PAD]", "E11"]
    assert all(torch.equal(loaded["state_dict"][k], v) for k, v in state.items())


def test_a_model_saved_before_a_head_field_existed_loads_as_the_model_it_was(tmp_path: Path) -> None:
    """A model.json without the fields added since (history max, token keys, age basis) describes a model
    without them: it must load into the same weights, not into today's defaults."""
    config = ModelConfig(vocab_size=30, hidden_size=16, num_layers=1, num_heads=2, label_attention_heads=2)
    old = dataclasses.replace(config, history_max=False, label_attention_keys="visit", age_basis=0)
    model = BehrtForMultiLabel(old, num_labels=4)
    save_bundle(tmp_path, "multilabel", old, model.state_dict(), labels=["A", "B", "C", "D"], pooling="visit")
    (tmp_path / S.DONE_MARKER).write_text("finetune\n")
    meta = json.loads((tmp_path / S.MODEL_META_FILE).read_text())
    for name in ("history_max", "label_attention_keys", "age_basis"):
        del meta["model_config"][name]
    (tmp_path / S.MODEL_META_FILE).write_text(json.dumps(meta))
    loaded = load_bundle(tmp_path, "multilabel")
    assert loaded["model_config"] == old
    multilabel_model(loaded)  # strict load: every weight in place, none missing


def test_weights_of_another_model_stop_with_one_line(tmp_path: Path) -> None:
    """model.safetensors and model.json of two runs side by side (a copied file, another version): a one-line
    ArtifactError naming the directory, both files and the first mismatch, not torch's many-line RuntimeError."""
    config = ModelConfig(vocab_size=30, hidden_size=16, num_layers=1, num_heads=2)
    model = BehrtForMultiLabel(config, num_labels=4)
    save_bundle(tmp_path, "multilabel", config, model.state_dict(), labels=["A", "B", "C", "D"], pooling="visit")
    (tmp_path / S.DONE_MARKER).write_text("finetune\n")
    meta = json.loads((tmp_path / S.MODEL_META_FILE).read_text())
    meta["model_config"]["hidden_size"] = 32
    (tmp_path / S.MODEL_META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ArtifactError) as err:
        multilabel_model(load_bundle(tmp_path, "multilabel"), tmp_path)
    message = str(err.value)
    assert message.startswith(f"{tmp_path}: {S.MODEL_WEIGHTS_FILE} does not fit the model {S.MODEL_META_FILE}")
    assert "size mismatch for encoder." in message and "\n" not in message


def test_save_bundle_refuses_a_value_json_cannot_hold_before_writing(tmp_path: Path) -> None:
    with pytest.raises(TypeError):
        save_bundle(tmp_path, "mlm", ModelConfig(vocab_size=5), {}, labels={1, 2})
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------------------
# planted pickles: refused, never run
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("plant", [plant_torch_pickle, plant_plain_pickle])
def test_pickle_planted_as_weights_is_refused_by_predict(
    trained: dict[str, Path], tmp_path: Path, plant, capsys: pytest.CaptureFixture[str]
) -> None:
    model = copy_of(trained["ft"], tmp_path / "model")
    target = tmp_path / "pwned"
    plant(model / S.MODEL_WEIGHTS_FILE, target)
    out = tmp_path / "pred.parquet"
    argv = ["predict", "--model", str(model), "--input", str(trained["raw"]), "--out", str(out), "progress=false"]
    assert main(argv) == 1
    err = one_line_error(capsys)
    assert f"{model / S.MODEL_WEIGHTS_FILE}: not a safetensors weights file" in err and "refusing" in err
    assert not target.exists() and not out.exists()


def test_legacy_pickle_model_file_is_refused_by_evaluate(
    trained: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model directory of older versions (or a planted one): only ``model.pt``, a pickle."""
    model = copy_of(trained["ft"], tmp_path / "model")
    (model / S.MODEL_WEIGHTS_FILE).unlink()
    (model / S.MODEL_META_FILE).unlink()
    target = tmp_path / "pwned"
    plant_torch_pickle(model / S.LEGACY_MODEL_FILE, target)
    argv = ["evaluate", "--model", str(model), "--data", str(trained["etl"]), "--out", str(tmp_path / "ev")]
    assert main(argv) == 1
    assert "refusing a pickle-based model file" in one_line_error(capsys)
    assert not target.exists()


def test_pickle_planted_as_description_is_refused_by_finetune(
    trained: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pre = copy_of(trained["pre"], tmp_path / "pre")
    target = tmp_path / "pwned"
    plant_plain_pickle(pre / S.MODEL_META_FILE, target)
    argv = ["finetune", "--data", str(trained["etl"]), "--out", str(tmp_path / "ft"), "--pretrained", str(pre)]
    assert main([*argv, *FINETUNE]) == 1
    assert "not a behrt-rope model description (invalid JSON" in one_line_error(capsys)
    assert not target.exists()


def test_pickle_planted_as_checkpoint_is_refused_on_resume(
    trained: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "pre"
    target = tmp_path / "pwned"
    (out / S.CHECKPOINT_DIR).mkdir(parents=True)
    plant_torch_pickle(out / S.CHECKPOINT_DIR / S.LAST_CHECKPOINT, target)
    assert main([*pretrain_argv(trained["etl"], out, "trainer.batch_size=16"), "--resume", "last"]) == 1
    err = one_line_error(capsys)
    assert "refusing to load the checkpoint" in err and "allow-list" in err
    assert not target.exists()


def test_real_checkpoints_load_with_weights_only(trained: dict[str, Path]) -> None:
    """What the trainer writes passes the weights-only loader (with an empty allow-list)."""
    for name in (S.LAST_CHECKPOINT, S.BEST_CHECKPOINT):
        checkpoint = load_checkpoint(trained["pre"] / S.CHECKPOINT_DIR / name)
        assert checkpoint["state_dict"] and checkpoint["global_step"] > 0


def test_truncated_weights_are_refused(trained: dict[str, Path], tmp_path: Path) -> None:
    model = copy_of(trained["ft"], tmp_path / "model")
    weights = model / S.MODEL_WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ArtifactError, match="not a safetensors weights file"):
        load_bundle(model, "multilabel")
