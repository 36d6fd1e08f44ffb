"""The typed config loader: nested sections keep their parent's defaults when only some keys are given."""

from __future__ import annotations

import pytest

from behrt_rope import config as config_lib
from pipelines import finetune, pretrain


def _build(module, *overrides: str):
    return config_lib.build(module.Config, config_lib.parse_overrides(list(overrides)))


def test_an_override_keeps_the_rest_of_the_sections_defaults():
    """finetune's trainer section has its own defaults (its default_factory), not TrainerConfig's class
    defaults; setting one trainer key must not silently bring the others back to the class's values."""
    untouched = finetune.Config()
    tweaked = _build(finetune, "trainer.progress_bar=false")
    assert tweaked.trainer.progress_bar is False
    assert tweaked.trainer.max_epochs == untouched.trainer.max_epochs != pretrain.Config().trainer.max_epochs
    assert tweaked.trainer.learning_rate == untouched.trainer.learning_rate
    assert tweaked.trainer.early_stopping_patience == untouched.trainer.early_stopping_patience
    assert _build(finetune, "trainer.max_epochs=3").trainer.learning_rate == untouched.trainer.learning_rate
    assert _build(pretrain, "trainer.progress_bar=false").trainer.max_epochs == pretrain.Config().trainer.max_epochs


@pytest.mark.parametrize(
    ("preset", "module"),
    [("configs/pretrain/laptop.yaml", pretrain), ("configs/finetune/next_visit.yaml", finetune)],
)
def test_presets_that_spell_out_the_defaults_still_equal_them(preset, module):
    """These two presets say they are the defaults spelled out: a changed default must change them too."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / preset
    assert path.read_text().startswith("# The defaults, spelled out")
    assert config_lib.build(module.Config, config_lib.load_yaml(path)) == module.Config()


def test_help_shows_the_sections_real_defaults():
    lines = config_lib.describe(finetune.Config)
    epochs = next(line for line in lines if line.strip().startswith("trainer.max_epochs ="))
    assert f"= {finetune.Config().trainer.max_epochs!r}" in epochs


def test_encoder_lr_scale_reaches_every_encoder_parameter_and_nothing_else():
    from behrt_rope.model.config import ModelConfig
    from behrt_rope.model.heads import BehrtForMultiLabel
    from behrt_rope.training.config import TrainerConfig
    from behrt_rope.training.optim import build_optimizer

    config = ModelConfig(vocab_size=20, hidden_size=16, num_heads=2, state_filter=3)
    model = BehrtForMultiLabel(config, 3, "visit", [5, 6, 7])
    optimizer, _ = build_optimizer(model, TrainerConfig(learning_rate=2.0, encoder_lr_scale=0.25), total_steps=10)
    peak_lr = {id(p): g["initial_lr"] for g in optimizer.param_groups for p in g["params"]}
    encoder = {id(p) for p in model.encoder.parameters()}
    state_filter = {id(p) for p in model.state_filter.parameters()}
    assert model.state_path is not None  # fitted apart after the deep training: not in its optimiser
    assert set(peak_lr) == {id(p) for p in model.parameters()} - {id(p) for p in model.state_path.parameters()}
    assert {peak_lr[i] for i in encoder} == {0.5}
    assert {peak_lr[i] for i in state_filter} == {20.0}  # its own multiplier (state_filter_lr_scale, 10)
    assert {lr for i, lr in peak_lr.items() if i not in encoder | state_filter} == {2.0}


def test_head_lr_scale_reaches_every_parameter_outside_the_encoder_and_the_wide_path():
    from behrt_rope.model.config import ModelConfig
    from behrt_rope.model.heads import BehrtForMultiLabel
    from behrt_rope.training.config import TrainerConfig
    from behrt_rope.training.optim import build_optimizer

    config = ModelConfig(vocab_size=20, hidden_size=16, num_heads=2, wide=True, state_filter=0, state_path=0)
    model = BehrtForMultiLabel(config, 3, "visit", [5, 6, 7])
    cfg = TrainerConfig(learning_rate=2.0, encoder_lr_scale=0.25, head_lr_scale=3.0, wide_lr_scale=10.0)
    optimizer, _ = build_optimizer(model, cfg, total_steps=10)
    peak_lr = {id(p): g["initial_lr"] for g in optimizer.param_groups for p in g["params"]}
    encoder = {id(p) for p in model.encoder.parameters()}
    wide = {id(p) for p in model.wide.parameters()}
    head = {id(p) for p in model.parameters()} - encoder - wide
    assert head >= {id(p) for p in model.classifier.parameters()} | {id(model.label_attention.time_value)}
    assert {peak_lr[i] for i in encoder} == {0.5}
    assert {peak_lr[i] for i in wide} == {20.0}  # the wide path's own multiplier, not the head's
    assert {peak_lr[i] for i in head} == {6.0}


@pytest.mark.parametrize("name", ["wide_lr_scale", "encoder_lr_scale", "head_lr_scale"])
def test_a_negative_learning_rate_multiplier_is_refused(name):
    from behrt_rope.training.config import TrainerConfig

    with pytest.raises(ValueError, match="head_lr_scale must be >= 0"):
        TrainerConfig(**{name: -1.0})
