"""Distillation in surgery.finetune: Hinton's logit loss, feature matching through capture hooks
with learned projections where shrink narrowed a layer, a teacher left untouched, the student
restored exactly, and one-line errors for teachers and layers that do not fit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import surgery
from surgery.analysis.metrics import accuracy
from surgery.core.checkpoints import load_checkpoint
from surgery.core.errors import ConfigError, SelectionError
from surgery.core.inputs import as_call
from surgery.ops.training.distillation import Distillation, DistillSpec
from surgery.tasks import digits
from surgery.testing import module_hook_counts, snapshot, snapshot_differences


def digits_cnn() -> nn.Module:
    return load_checkpoint(digits.DigitsCNN(), digits.CHECKPOINT).eval()


def batches(count: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return digits.digits_batches("train", 32, limit_batches=count)


def test_the_logit_loss_is_hintons_kl_at_temperature_mixed_with_the_task_loss():
    student, teacher = digits_cnn(), digits_cnn()
    pruned = surgery.prune(student, 0.8, scope="global")
    hooks = module_hook_counts(student)
    x, y = batches(1)[0]
    spec = DistillSpec(temperature=3.0, weight=0.7)
    with Distillation(student, teacher, spec) as distillation:
        distillation.prepare(as_call(x))
        s = student(x)
        task = F.cross_entropy(s, y)
        found = distillation.loss(s, y, as_call(x), task)
    with torch.no_grad():
        t = teacher(x)
    p_teacher = F.softmax(t / 3.0, dim=-1)
    kl = (p_teacher * (p_teacher.log() - F.log_softmax(s / 3.0, dim=-1))).sum(-1).mean()
    assert torch.allclose(found, 0.3 * task + 0.7 * 9.0 * kl, rtol=1e-5)
    assert module_hook_counts(student) == hooks  # the capture hooks left with the block
    pruned.restore()


def test_distilling_a_pruned_cnn_keeps_its_masks_leaves_the_teacher_untouched_and_restores_exactly():
    student, teacher = digits_cnn(), digits_cnn()
    original, teacher_before = snapshot(student), copy.deepcopy(teacher.state_dict())
    pruned = surgery.prune(student, 0.9, scope="global")
    masks = pruned.masks()
    spec = DistillSpec(features=["conv2", "fc1"])
    tuned = surgery.finetune(student, calibration=batches(), teacher=teacher, distill=spec, progress=False)
    assert tuned.distilled == ["conv2", "fc1"] and len(tuned.projections) == 0  # same widths: no projection
    assert all(not student.get_parameter(n).detach()[~m].any() for n, m in masks.items())
    assert all(torch.equal(v, teacher_before[k]) for k, v in teacher.state_dict().items()) and not teacher.training
    assert all(count == 0 for count in module_hook_counts(teacher).values())
    surgery.compose(pruned, tuned).restore()
    assert not snapshot_differences(original, snapshot(student))


def test_a_shrunk_layer_is_matched_through_a_learned_projection_dropped_at_bake():
    student, teacher = digits_cnn(), digits_cnn()
    shrunk = surgery.shrink(student, 0.5, calibration=batches(1)[0][0])
    spec = DistillSpec(features=["conv2", "fc1"])
    tuned = surgery.finetune(student, calibration=batches(), teacher=teacher, distill=spec, progress=False)
    widths = {name: tuple(p.weight.shape) for name, p in tuned.projections.items()}
    assert widths == {"conv2": (32, 16), "fc1": (64, 32)}  # student width -> teacher width
    assert tuned.projections["fc1"].weight.grad is not None or tuned.projections["fc1"].weight.abs().sum() > 32
    parameters = {n for n, _ in student.named_parameters()}
    tuned.bake()
    assert {n for n, _ in student.named_parameters()} == parameters  # nothing of the projections in the model
    shrunk.bake()
    matched = surgery.finetune(
        student,
        calibration=batches(),
        teacher=teacher,
        distill=DistillSpec(features=["conv2"], widths="match"),
        progress=False,
    )
    assert len(matched.projections) == 0 and matched.distilled == ["conv2"]
    matched.restore()


def test_distillation_trains_through_quantization_aware_training():
    student, teacher = digits_cnn(), digits_cnn()
    quantized = surgery.quantize(student, weights=surgery.GridSpec(bits=4, symmetric=True), train=True)
    tuned = surgery.finetune(
        student, calibration=batches(), teacher=teacher, distill={"temperature": 2.0}, progress=False
    )
    assert len(tuned.curve) == 2
    surgery.compose(quantized, tuned).restore()


def test_on_the_digits_cnn_pruned_to_90_percent_distillation_recovers_more_than_fine_tuning():
    test = digits.digits_batches("test", 256)
    train = digits.digits_batches("train", 32)
    scores = {}
    for mode in ("fine-tune", "distill"):
        torch.manual_seed(0)
        student, teacher = digits_cnn(), digits_cnn()
        surgery.prune(student, 0.9, scope="global")
        kwargs = {"teacher": teacher, "distill": DistillSpec()} if mode == "distill" else {}
        surgery.finetune(student, calibration=train, epochs=1, lr=3e-3, progress=False, **kwargs)
        scores[mode] = accuracy(student, test)
    # measured (benchmarks/bench_recovery.py): 0.930 pruned, 0.983 fine-tuned, 0.992 distilled, 45 steps
    assert scores["distill"] > scores["fine-tune"] and scores["distill"] > 0.985, scores


@pytest.mark.parametrize(
    "teacher, settings, error, match",
    [
        (lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 7)), {}, ConfigError, r"^finetune.teacher='output': its"),
        (digits_cnn, {"features": ["conv3"]}, SelectionError, r"^finetune.distill.features='conv3': matches no"),
        (
            lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 10)),
            {"features": ["conv2"]},
            ConfigError,
            r"^finetune.distill.features='conv2': is in the student but not in the teacher",
        ),
        (digits_cnn, {"temperature": 0}, ConfigError, r"^finetune.distill.temperature=0: must be a number > 0"),
        (digits_cnn, {"widths": "pad"}, ConfigError, r"^finetune.distill.widths='pad': must be one of project, match"),
        (digits_cnn, {"colour": 1}, ConfigError, r"^finetune.distill='colour': unknown setting"),
    ],
)
def test_teachers_and_layers_that_do_not_fit_are_one_line_and_change_nothing(teacher, settings, error, match):
    student = digits_cnn()
    before = snapshot(student)
    with pytest.raises(error, match=match):
        surgery.finetune(student, calibration=batches(2), teacher=teacher(), distill=settings, progress=False)
    assert not snapshot_differences(before, snapshot(student))
    assert all(count == 0 for count in module_hook_counts(student).values())


def test_a_teacher_that_is_the_student_or_missing_is_one_line():
    student = digits_cnn()
    with pytest.raises(ConfigError, match=r"^finetune.teacher='DigitsCNN': is the model being trained"):
        surgery.finetune(student, calibration=batches(2), teacher=student, progress=False)
    shallow = copy.copy(student)  # shares the parameters
    with pytest.raises(ConfigError, match=r"^finetune.teacher='DigitsCNN': shares 12 parameter"):
        surgery.finetune(student, calibration=batches(2), teacher=shallow, progress=False)
    with pytest.raises(ConfigError, match=r"^finetune.teacher: distillation learns from the uncompressed model"):
        surgery.finetune(student, calibration=batches(2), distill={"temperature": 2.0}, progress=False)


def test_a_feature_layer_running_twice_and_keywords_beside_a_spec_are_one_line():
    import torchvision

    student, teacher = torchvision.models.resnet18(num_classes=4), torchvision.models.resnet18(num_classes=4)
    pairs = [(torch.randn(2, 3, 32, 32), torch.tensor([0, 1]))]
    with pytest.raises(ConfigError, match=r"^finetune.distill.features='layer1.0.relu': ran 2 times in one forward"):
        surgery.finetune(
            student, calibration=pairs, teacher=teacher, distill={"features": ["layer1.0.relu"]}, progress=False
        )
    spec = surgery.FinetuneSpec()
    with pytest.raises(ConfigError, match=r"^finetune.distill=.*: is given beside a FinetuneSpec: set it in the spec"):
        surgery.finetune(
            student, calibration=pairs, spec=spec, teacher=teacher, distill={"features": ["layer1"]}, progress=False
        )
    with pytest.raises(ConfigError, match=r"^finetune.lr=5.0: is given beside a FinetuneSpec"):
        surgery.finetune(student, calibration=pairs, spec=spec, lr=5.0, progress=False)


def test_distilling_a_one_output_model_is_one_line_and_changes_nothing():
    def one_output() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 1))

    student, teacher = one_output(), one_output()
    before = snapshot(student)
    pairs = [(x, y.float()[:, None]) for x, y in batches(2)]
    with pytest.raises(ConfigError, match=r"^finetune.distill.weight=0.5: distils the output, of shape \(32, 1\)"):
        surgery.finetune(student, calibration=pairs, teacher=teacher, loss=F.mse_loss, progress=False)
    assert not snapshot_differences(before, snapshot(student))
    surgery.finetune(
        student, calibration=pairs, teacher=teacher, loss=F.mse_loss, distill={"weight": 0.0}, progress=False
    )


def test_a_teacher_in_another_dtype_is_one_line_saying_which():
    student = nn.Sequential(nn.Linear(8, 4))
    teacher = copy.deepcopy(student).double()
    batches = [(torch.randn(2, 8), torch.tensor([0, 1]))]
    before = {n: p.detach().clone() for n, p in student.named_parameters()}
    with pytest.raises(ConfigError, match=r"^finetune.teacher='Sequential': fails on the first .* torch.float64 and"):
        surgery.finetune(student, calibration=batches, teacher=teacher, progress=False)
    assert all(torch.equal(p, before[n]) for n, p in student.named_parameters())
