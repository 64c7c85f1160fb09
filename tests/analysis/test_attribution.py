"""surgery.attribution: Grad-CAM, Grad-CAM++ and input × gradient from a forward hook and a
tensor hook, equal to pytorch-grad-cam on resnet50; token maps for transformers; the drift of
the maps between a model and its compressed copy; one-line errors."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torchvision
from torch import nn

import surgery
from surgery.core.errors import ConfigError
from surgery.testing import module_hook_counts, snapshot, snapshot_differences


def images(count: int = 2, size: int = 64) -> torch.Tensor:
    return torch.randn(count, 3, size, size, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("method, reference", [("gradcam", "GradCAM"), ("gradcam_plus_plus", "GradCAMPlusPlus")])
def test_maps_equal_pytorch_grad_cam_on_resnet50(method, reference):
    cams = pytest.importorskip("pytorch_grad_cam")
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    torch.manual_seed(0)
    model = torchvision.models.resnet50().eval()
    x = images()
    ours = surgery.attribution(model, x, method=method, select="layer4")
    with getattr(cams, reference)(model=model, target_layers=[model.layer4]) as cam:
        theirs = cam(input_tensor=x, targets=[ClassifierOutputTarget(int(t)) for t in ours.targets])
    assert ours.maps.shape == (2, 64, 64) and ours.layer == "layer4"
    # float32 in both; theirs through numpy and cv2's bilinear resize: measured within 3e-6
    assert (ours.maps - torch.from_numpy(theirs)).abs().max() < 1e-5


def test_input_x_gradient_is_the_input_times_its_gradient_summed_over_channels():
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = images()
    found = surgery.attribution(model, x, method="input_x_gradient", target=3)
    leaf = x.clone().requires_grad_(True)
    model(leaf)[:, 3].sum().backward()
    expected = (leaf * leaf.grad).sum(1).abs().detach()
    flat = expected.flatten(1)
    expected = ((flat - flat.min(1, keepdim=True).values) / (1e-7 + (flat - flat.min(1, keepdim=True).values).max(1, keepdim=True).values)).reshape(expected.shape)  # fmt: skip
    assert torch.allclose(found.maps, expected, atol=1e-6) and found.layer == "input"
    assert found.targets.tolist() == [3, 3]


def test_every_hook_leaves_and_the_model_is_as_it_was():
    model = torchvision.models.resnet18().train()
    before = snapshot(model)
    model.fc.weight.grad = torch.ones_like(model.fc.weight)
    surgery.attribution(model, images(), select="layer3")
    assert model.training and all(count == 0 for count in module_hook_counts(model).values())
    assert torch.equal(model.fc.weight.grad, torch.ones_like(model.fc.weight))  # the caller's gradient
    assert model.layer1[0].conv1.weight.grad is None
    assert not snapshot_differences(before, snapshot(model))


def test_transformers_give_one_value_per_token():
    timm = pytest.importorskip("timm")
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=10).eval()
    found = surgery.attribution(vit, torch.randn(2, 3, 32, 32), select="blocks.11")
    assert found.maps.shape == (2, 5)  # the class token and 2 x 2 patches
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, num_labels=3
    )
    torch.manual_seed(0)
    bert = transformers.BertForSequenceClassification(config).eval()
    ids = torch.randint(0, 50, (2, 7))
    for method in ("gradcam", "input_x_gradient"):
        found = surgery.attribution(bert, {"input_ids": ids}, method=method, select="bert.embeddings")
        assert found.maps.shape == (2, 7)
        assert 0.99 < found.maps.max() <= 1  # scaled as pytorch-grad-cam: max / (max + 1e-7)


def test_attribution_drift_is_one_for_a_copy_and_falls_with_compression():
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    batches = [images(4)]
    same = surgery.compare(model, copy.deepcopy(model), batches, attribution={"select": "layer3", "top_k": 0.2})
    assert same.attribution.cosine == pytest.approx([1.0] * 4) and same.attribution.overlap == [1.0] * 4
    pruned = copy.deepcopy(model)
    surgery.prune(pruned, 0.5)
    drift = surgery.compare(model, pruned, batches, attribution={"select": "layer3", "top_k": 0.2})
    # measured: mean cosine 0.986 at 30 %; 50 % moves it further
    assert 0 < drift.attribution.mean_cosine < 0.999 and drift.attribution.mean_overlap < 1
    assert drift.attribution.as_dict()["layer"] == "layer3" and drift.attribution.reference_maps.shape == (4, 64, 64)


def test_a_candidate_giving_nan_has_a_nan_cosine():
    model = torchvision.models.resnet18().eval()
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.layer3[0].conv1.weight[0, 0, 0, 0] = float("nan")
    drift = surgery.compare(model, broken, [images()], attribution={"select": "layer3"})
    assert math.isnan(drift.attribution.mean_cosine)  # no bound passes it (tests/cli/test_checks.py)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"select": "fc"}, r"^attribution.select='fc': gives \(2, 1000\): no spatial or token axis"),
        ({"select": "layer4", "target": 1000}, r"^attribution.target=1000: is not a class index: the model has 1000"),
        ({"select": "layer*"}, r"^attribution.select='layer\*': matches 4 layers"),
        ({"select": "layer4", "method": "lime"}, r"^attribution.method='lime': must be one of gradcam"),
    ],
)
def test_bad_attribution_requests_are_one_line(kwargs, match):
    model = torchvision.models.resnet18().eval()
    with pytest.raises(ConfigError, match=match):
        surgery.attribution(model, images(), **kwargs)
    assert all(count == 0 for count in module_hook_counts(model).values())


def test_the_channel_axis_follows_the_layer_not_its_type():
    cams = pytest.importorskip("pytorch_grad_cam")
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    torch.manual_seed(0)
    vgg = torchvision.models.vgg11().eval()  # pytorch-grad-cam's README maps VGG at features[-1], a MaxPool2d
    x = images()
    ours = surgery.attribution(vgg, x, select="features.20")
    with cams.GradCAM(model=vgg, target_layers=[vgg.features[20]]) as cam:
        theirs = cam(input_tensor=x, targets=[ClassifierOutputTarget(int(t)) for t in ours.targets])
    assert (ours.maps - torch.from_numpy(theirs)).abs().max() < 1e-5
    timm = pytest.importorskip("timm")
    vit = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=10).eval()
    assert surgery.attribution(vit, torch.randn(2, 3, 32, 32), select="patch_embed").maps.shape == (2, 4)  # patches
    swin = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=10).eval()
    assert surgery.attribution(swin, torch.randn(1, 3, 224, 224), select="layers.3").maps.shape == (1, 224, 224)


def test_a_shared_module_is_refused_and_in_place_ops_after_the_layer_change_nothing():
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    with pytest.raises(ConfigError, match=r"^attribution.select='layer4.1.relu': ran 2 times in one forward"):
        surgery.attribution(model, images(), select="layer4.1.relu")  # torchvision reuses a block's ReLU
    out_of_place = copy.deepcopy(model)
    for module in out_of_place.modules():
        if isinstance(module, nn.ReLU):
            module.inplace = False
    kept = surgery.attribution(model, images(), select="layer4.1.bn2")  # then += identity and relu_ in place
    assert torch.equal(kept.maps, surgery.attribution(out_of_place, images(), select="layer4.1.bn2").maps)
    with pytest.raises(ConfigError, match=r"^attribution.select='layer4': gives \(2, 512, 1, 1\): one position"):
        surgery.attribution(model, images(2, 32), select="layer4")


@pytest.mark.parametrize("target", [1.5, True, "cat", [0.5, 1.0]])
def test_a_target_that_is_not_a_class_index_is_refused(target):
    from surgery.analysis.attribution import AttributionSpec

    with pytest.raises(ConfigError, match=r"^attribution.target=.*: must be a class index"):
        AttributionSpec(target=target)
    model = nn.Sequential(nn.Linear(4, 3)).eval()
    with pytest.raises(ConfigError, match=r"^attribution.target=.*: must be a class index"):
        surgery.attribution(model, torch.randn(2, 4), method="input_x_gradient", target=target)
