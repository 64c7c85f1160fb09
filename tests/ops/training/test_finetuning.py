"""surgery.finetune: training with surgery attached, restorable, interrupted cleanly."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import surgery
from surgery.core.errors import ConfigError
from surgery.ops.training.finetuning import OPTIMIZERS, finetune
from surgery.testing import global_hook_counts, snapshot, snapshot_differences


def labelled(mlp_input: torch.Tensor, count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(mlp_input + i, torch.randint(0, 4, (mlp_input.shape[0],), generator=generator)) for i in range(count)]


@pytest.mark.parametrize("optimizer", OPTIMIZERS.names())
def test_finetuning_with_masks_attached_keeps_them_and_restores_exactly(mlp, mlp_input, optimizer):
    before = snapshot(mlp)
    pruned = surgery.prune(mlp, 0.5, progress=False)
    masks = pruned.masks()
    scores = iter(range(100))
    tuned = finetune(
        mlp,
        calibration=labelled(mlp_input),
        epochs=2,
        lr=0.05,
        optimizer=optimizer,
        progress=False,
        evaluate=lambda model: float(next(scores)),
        eval_every=3,
    )
    assert [p.step for p in tuned.curve] == [0, 3, 6, 8] and [p.score for p in tuned.curve] == [0, 1, 2, 3]
    assert tuned.curve[0].loss is None and all(p.loss > 0 for p in tuned.curve[1:])
    assert all(not mlp.get_parameter(n).detach()[~m].any() for n, m in masks.items())
    assert snapshot_differences(before, snapshot(mlp))  # trained
    surgery.compose(pruned, tuned).restore()
    assert snapshot_differences(before, snapshot(mlp)) == []  # bit for bit, hooks included


def test_an_interrupted_finetune_puts_the_model_back_and_leaves_no_hook(mlp, mlp_input):
    pruned = surgery.prune(mlp, 0.5, progress=False)
    after_pruning = snapshot(mlp)
    calls = []

    def loss(output, target):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return nn.functional.cross_entropy(output, target)

    with pytest.raises(KeyboardInterrupt):
        finetune(mlp, calibration=labelled(mlp_input), epochs=2, loss=loss, progress=False)
    assert snapshot_differences(after_pruning, snapshot(mlp)) == []  # the two steps taken are undone
    assert mlp.training is False
    pruned.restore()


def test_a_diverging_loss_stops_with_one_line_and_the_model_put_back(mlp, mlp_input):
    before = snapshot(mlp)
    with pytest.raises(ConfigError, match=r"finetune\.lr=.*the loss became (nan|inf).*lower the learning rate"):
        finetune(mlp, calibration=labelled(mlp_input), epochs=3, lr=1e30, optimizer="sgd", progress=False)
    assert snapshot_differences(before, snapshot(mlp)) == []


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"epochs": -1}, r"finetune\.epochs=-1: must be a whole number of epochs from 0 to 10,000"),
        ({"epochs": 10**9}, r"finetune\.epochs=1000000000: must be a whole number of epochs from 0 to 10,000"),
        ({"max_steps": 10**9}, r"finetune\.max_steps=1000000000: must be a whole number of steps \(or null\)"),
        ({"lr": float("nan")}, r"finetune\.lr=nan: must be a finite number >= 0"),
        (
            {"optimizer": "adamx"},
            r"finetune\.optimizer='adamx': must be one of adamw, adam, sgd, adagrad, rmsprop \(did you mean",
        ),
        ({"eval_every": 0}, r"finetune\.eval_every=0: must be null or an integer >= 1"),
    ],
)
def test_bad_settings_are_one_line_errors(mlp, mlp_input, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        finetune(mlp, calibration=labelled(mlp_input), progress=False, **kwargs)


def test_batches_must_be_labelled_pairs(mlp, mlp_input):
    with pytest.raises(
        ConfigError, match=r"finetune\.calibration='Tensor': each batch must be an \(inputs, target\) pair"
    ):
        finetune(mlp, calibration=[mlp_input], progress=False)


def test_a_hugging_face_model_with_dict_inputs_finetunes_with_its_own_loss(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
        num_labels=2,
    )
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).eval()
    pruned = surgery.prune(model, 0.5, select="bert.encoder.**", progress=False)
    masks = pruned.masks()
    ids = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(0))
    batches = [({"input_ids": ids, "labels": torch.tensor([0, 1, 0, 1])}, None)] * 3
    tuned = finetune(model, calibration=batches, epochs=2, lr=1e-2, loss=lambda output, _: output.loss, progress=False)
    assert [p.step for p in tuned.curve] == [0, 3, 6]  # one point per epoch
    assert all(not model.get_parameter(n).detach()[~m].any() for n, m in masks.items())
    surgery.compose(pruned, tuned).restore()
    assert global_hook_counts()["_global_optimizer_post_hooks"] == 0


def test_a_hugging_face_language_model_trains_with_the_default_loss_per_token():
    from support import tiny_llama  # tests/support.py

    model = tiny_llama(layers=1)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    batches = [(ids[:, :-1], ids[:, 1:])]  # the next tokens as targets
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
    before = float(torch.nn.functional.cross_entropy(logits.reshape(-1, 128), ids[:, 1:].reshape(-1)))
    handle = finetune(model, calibration=batches, epochs=3, lr=1e-2, evaluate=lambda m: 0.0, progress=False)
    assert handle.curve[0].loss is None and handle.curve[-1].loss < before
    handle.restore()


def test_a_run_longer_than_an_hour_at_the_first_step_s_pace_is_said_before_it_goes_on(
    mlp, mlp_input, caplog, monkeypatch
):
    """Hostile pass, wave 4, item 11: step counts are bounded, and a long run says how long."""
    from surgery.ops.training import finetuning

    monkeypatch.setattr(finetuning, "LONG_RUN", 0.0)  # every run is "long" here
    with caplog.at_level(logging.WARNING, logger="surgery"):
        handle = finetune(mlp, calibration=labelled(mlp_input), epochs=2, lr=1e-3, optimizer="sgd", progress=False)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("finetune: ")]
    assert len(said) == 1 and "steps will take about" in said[0] and "at the first step's pace" in said[0]
    handle.restore()
