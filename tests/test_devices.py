"""Every verb keeps a model on the device it is on: parameters, masks and grids stay there, the
calibration batches are moved there, and the result computes what the same verb gives on the
CPU. Parametrized over the devices present (``support.devices``): the CPU here, CUDA too where a
GPU is (``scripts/gpu_check.sh`` runs those with ``-m cuda``)."""

from __future__ import annotations

import pytest
import torch
from support import devices, tiny_llama, tiny_moe  # tests/support.py

import surgery
from surgery import GridSpec
from surgery.testing import assert_no_hooks

IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
CALIBRATION = [torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
METHODS = {  # quantize()'s keywords: the grid and the method
    "rtn": {"weights": GridSpec(bits=4, group_size=32)},
    "gptq": {"weights": GridSpec(bits=4, group_size=32), "method": "gptq"},
    "autoround": {"weights": GridSpec(bits=4, group_size=32), "method": surgery.AutoRoundSettings(iterations=4)},
}


def on(device: str) -> torch.nn.Module:
    return tiny_llama(layers=2).to(device)


def held_on(model: torch.nn.Module, device: str) -> bool:
    return all(t.device.type == device for t in [*model.parameters(), *model.buffers()])


def logits(model: torch.nn.Module, device: str) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS.to(device)).logits.float().cpu()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("method", list(METHODS))
def test_quantize_stays_on_the_device_and_computes_what_the_cpu_computes(device, method):
    reference = on("cpu")
    with surgery.quantize(reference, **METHODS[method], calibration=CALIBRATION, exclude="lm_head"):
        expected = logits(reference, "cpu")
    model = on(device)
    before = logits(model, device)
    batches = [batch.to(device) for batch in CALIBRATION]
    with surgery.quantize(model, **METHODS[method], calibration=batches, exclude="lm_head"):
        assert held_on(model, device)
        found = logits(model, device)
    assert held_on(model, device) and torch.equal(logits(model, device), before)  # restored exactly
    # another device's kernels sum in another order: a rounding step apart at most in a few weights
    assert torch.nn.functional.cosine_similarity(found.flatten(), expected.flatten(), dim=0) > 0.999


@pytest.mark.parametrize("device", devices())
def test_calibration_given_on_the_cpu_is_moved_to_the_model_s_device(device):
    model = on(device)
    with surgery.quantize(model, **METHODS["gptq"], calibration=CALIBRATION, exclude="lm_head"):
        assert held_on(model, device)


class ConvNet(torch.nn.Sequential):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(
            torch.nn.Conv2d(3, 8, 3, padding=1),
            torch.nn.BatchNorm2d(8),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, 4),
        )


PICTURES = [torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
GIVEN_ON_THE_CPU = {  # found by reading: each ran the model on the batches as given, not moved
    "fold batchnorms, tensor sites": lambda d: surgery.quantize(ConvNet().to(d), target="onnx", calibration=PICTURES),
    "rotate": lambda d: surgery.rotate(on(d), calibration=CALIBRATION, progress=False),
    "smooth": lambda d: surgery.smooth(on(d), 0.5, calibration=CALIBRATION, progress=False),
    "compare, per layer": lambda d: surgery.compare(on(d), on(d), CALIBRATION, per_layer=True),
    "attribution drift": lambda d: surgery.attribution_drift(
        ConvNet().to(d).eval(), ConvNet().to(d).eval(), PICTURES, {"method": "gradcam"}
    ),
    "finetune": lambda d: surgery.finetune(
        ConvNet().to(d), calibration=[(PICTURES[0], torch.tensor([0, 1]))], max_steps=1, progress=False
    ),
    "sensitivity": lambda d: surgery.sensitivity(
        on(d), (0.5,), calibration=CALIBRATION[:1], select="model.layers.0.mlp.**"
    ),
}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("verb", list(GIVEN_ON_THE_CPU))
def test_a_model_on_the_device_takes_batches_given_on_the_cpu(device, verb):
    """Every call of a model on a batch moves the batch to the device the model computes on
    (``Call``): on a GPU these raised "Expected all tensors to be on the same device"."""
    done = GIVEN_ON_THE_CPU[verb](device)
    model = getattr(done, "model", None)
    if isinstance(model, torch.nn.Module):
        assert held_on(model, device)
    if hasattr(done, "restore"):
        done.restore()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_prune_stays_on_the_device(device, method):
    model = on(device)
    batches = [batch.to(device) for batch in CALIBRATION]
    with surgery.prune(model, 0.5, method=method, calibration=batches, exclude="lm_head"):
        assert held_on(model, device)
        weight = model.model.layers[0].mlp.up_proj.weight
        assert weight.device.type == device and (weight == 0).float().mean().item() == pytest.approx(0.5, abs=0.02)


@pytest.mark.parametrize("device", devices())
def test_a_device_model_exports_with_its_parity_held(device, tmp_path):
    model = on(device)
    with surgery.quantize(model, **METHODS["rtn"], exclude="lm_head") as handle:
        record = surgery.export(handle, tmp_path / "m", format="compressed-tensors", inputs=[IDS.to(device)])
    assert record.parity.holds, record.parity


@pytest.mark.slow  # ~15 s: a run with its round-trip checks and the GGUF deploy check
@pytest.mark.parametrize("device", devices())
def test_a_run_on_model_device_checks_and_exports_as_on_the_cpu(device, tmp_path):
    from support import run_recipe

    args = ("recipe=quantize_llama_gguf", "quantize.method=gptq", "data.batches=1", f"model.device={device}")
    report = run_recipe(tmp_path, *args)
    assert report["ok"] and {check["name"] for check in report["checks"] if not check["passed"]} == set()
    assert report["deploy"]["max_abs"] == 0.0  # the GGUF file computes the run's logits bit for bit


@pytest.mark.slow  # ~15 s: a run with its round-trip checks and the GGUF deploy check
@pytest.mark.parametrize("device", devices())
def test_a_run_onloading_each_block_reports_its_peak_and_exports_as_without(device, tmp_path):
    from support import run_recipe

    args = (
        "recipe=quantize_llama_gguf",
        "quantize.method=gptq",
        "data.batches=1",
        f"+quantize.onload={device}",
    )
    report = run_recipe(tmp_path, *args)
    assert report["ok"] and {check["name"] for check in report["checks"] if not check["passed"]} == set()
    assert report["deploy"]["max_abs"] == 0.0
    if device == "cuda":
        assert report["onload"]["quantize"]["blocks"] >= 2 and min(report["onload"]["quantize"]["gpu_peak_bytes"]) > 0
    else:
        assert "onload" not in report  # nothing went to a GPU


@pytest.mark.parametrize("device", devices())
def test_percentile_activation_ranges_are_observed_on_the_device(device):
    model = on(device)
    activations = GridSpec(bits=8, observer="percentile", percentile=99.9)
    batches = [batch.to(device) for batch in CALIBRATION]
    with surgery.quantize(model, activations=activations, calibration=batches, exclude="lm_head"):
        assert held_on(model, device) and torch.isfinite(logits(model, device)).all()


@pytest.mark.parametrize("device", devices())
def test_expert_pruning_scores_on_the_device_and_keeps_the_model_there(device):
    from support import tiny_moe

    model = tiny_moe("qwen3_moe").to(device)
    batches = [torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(i)).to(device) for i in range(2)]
    with surgery.prune_experts(model, 0.25, calibration=batches) as handle:
        assert held_on(model, device)
        assert all(len(kept) == 3 for kept in handle.kept.values()), handle.kept  # one of four experts gone


@pytest.mark.parametrize("device", devices())
def test_an_offloaded_model_brings_each_block_onto_the_device_and_quantizes_there(device, tmp_path):
    model = tiny_llama(layers=2)
    model.save_pretrained(tmp_path / "model")
    expected_float = logits(model.to(device), device)
    weights = METHODS["gptq"]
    with surgery.quantize(model, **weights, calibration=CALIBRATION, exclude="lm_head"):
        expected = logits(model, device)
    source = surgery.offloaded(tmp_path / "model", device=device)
    with torch.no_grad():
        found = source.model(IDS).logits.float().cpu()  # the ids given on the CPU: moved where the blocks run
    assert torch.equal(found, expected_float)
    done = surgery.quantize(source, **weights, calibration=CALIBRATION, exclude="lm_head")
    assert torch.allclose(logits(done.model, device), expected, atol=1e-5)  # bit-equal on the CPU (a test)
    if device == "cuda":
        assert len(done.gpu_peak_bytes) == 2 and min(done.gpu_peak_bytes) > 0  # each block's peak, for the report


def test_an_offloaded_device_this_machine_lacks_is_refused_in_one_line(tmp_path):
    from surgery.core.errors import ConfigError

    tiny_llama(layers=1).save_pretrained(tmp_path / "model")
    with pytest.raises(ConfigError, match=r"^offloaded\.device='tpu': must be cpu, cuda, cuda:N or mps$"):
        surgery.offloaded(tmp_path / "model", device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^offloaded\.device='cuda': is not on this machine \(no CUDA GPU\)$"):
            surgery.offloaded(tmp_path / "model", device="cuda")


ONLOADED = {
    "gptq": lambda m, b, device: surgery.quantize(
        m, **METHODS["gptq"], calibration=b, exclude="lm_head", onload=device, progress=False
    ),
    "autoround": lambda m, b, device: surgery.quantize(
        m, **METHODS["autoround"], calibration=b, exclude="lm_head", onload=device, progress=False
    ),
    "sparsegpt": lambda m, b, device: surgery.prune(
        m, 0.5, method="sparsegpt", calibration=b, exclude="lm_head", onload=device, progress=False
    ),
    "wanda": lambda m, b, device: surgery.prune(
        m, 0.5, method="wanda", calibration=b, exclude="lm_head", onload=device, progress=False
    ),
}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("verb", list(ONLOADED))
def test_onload_runs_each_block_on_the_device_and_leaves_the_model_where_it_was(device, verb):
    """A model in CPU memory, each block moved to ``device`` for its stage and back: the blocks
    compute there, the model ends on the CPU, and the result is the CPU's (bit for bit on the
    CPU; a rounding step apart at most in a few weights on another device's kernels)."""
    reference = on("cpu")
    with ONLOADED[verb](reference, CALIBRATION, None):
        expected = logits(reference, "cpu")
    model = on("cpu")
    before = logits(model, "cpu")
    ran_on = set()
    watch = [
        layer.register_forward_pre_hook(lambda module, args: ran_on.add(args[0].device.type))
        for layer in model.model.layers
    ]
    with ONLOADED[verb](model, CALIBRATION, device) as handle:
        for hook in watch:
            hook.remove()
        assert held_on(model, "cpu")
        found = logits(model, "cpu")
        peaks = handle.sequential.gpu_peak_bytes  # each block's peak on the GPU, where it ran on one
        assert len(peaks) == (len(model.model.layers) if device == "cuda" else 0) and all(p > 0 for p in peaks)
    assert device in ran_on
    assert held_on(model, "cpu") and torch.equal(logits(model, "cpu"), before)
    assert_no_hooks(model)
    if device == "cpu":
        assert torch.equal(found, expected)
    else:
        assert torch.nn.functional.cosine_similarity(found.flatten(), expected.flatten(), dim=0) > 0.999


@pytest.mark.parametrize("device", devices())
def test_a_stage_that_fails_while_onloaded_leaves_the_model_where_it_was_and_unchanged(device):
    model = on("cpu")
    state = {name: t.clone() for name, t in model.state_dict().items()}
    calls = []

    def fail_in_the_second_block_s_stage(module, args):
        calls.append(args[0].device.type)
        if len(calls) == 2:  # the first call is the forward that traces the stages
            raise RuntimeError("the second block failed")

    failing = model.model.layers[1].mlp.register_forward_pre_hook(fail_in_the_second_block_s_stage)
    with pytest.raises(RuntimeError, match="the second block failed"):
        ONLOADED["gptq"](model, CALIBRATION, device)
    failing.remove()
    assert calls[1] == device  # it failed on the device, after the first block was written
    assert held_on(model, "cpu")
    assert all(torch.equal(t, state[name]) for name, t in model.state_dict().items())
    assert_no_hooks(model)


def _moe() -> torch.nn.Module:
    return tiny_moe("qwen3_moe", layers=2)


def _vit() -> torch.nn.Module:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10).eval()


IMAGES = [torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)]
NOT_WRITTEN_HERE = {  # model, calibration, what to leave out
    "qwen3_moe": (_moe, CALIBRATION, "lm_head"),
    "timm_vit": (_vit, IMAGES, "head"),
}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("model_name", list(NOT_WRITTEN_HERE))
def test_onload_on_a_mixture_of_experts_and_a_timm_model_computes_the_plain_run(device, model_name):
    """Found by trying as a new user: onload moves whatever blocks sequential calibration finds,
    experts and a timm ViT's blocks included; the experts are quantized on the device too."""
    make, batches, leave_out = NOT_WRITTEN_HERE[model_name]
    spec = GridSpec(bits=4, group_size=16)
    outputs = []
    for onload in (None, device):
        model = make()
        first = batches[0]
        with torch.no_grad():
            before = _output(model(first))
        with surgery.quantize(
            model, weights=spec, method="gptq", calibration=batches, exclude=leave_out, onload=onload, progress=False
        ) as handle:
            assert held_on(model, "cpu") and len(handle.sequential.blocks) == 2
            assert model_name != "qwen3_moe" or sum("experts" in name for name in handle.weights) == 2 * 4 * 3
            with torch.no_grad():
                outputs.append(_output(model(first)))
            assert not torch.equal(outputs[-1], before)
        assert_no_hooks(model)
    if device == "cpu":
        assert torch.equal(outputs[0], outputs[1])
    else:
        assert torch.nn.functional.cosine_similarity(outputs[0].flatten(), outputs[1].flatten(), dim=0) > 0.999


def _output(found) -> torch.Tensor:
    return (found.logits if hasattr(found, "logits") else found).float()


def test_onload_is_refused_where_it_cannot_apply_in_one_line(tmp_path):
    model = on("cpu")
    with pytest.raises(surgery.ConfigError, match=r"^quantize\.onload='cuda:99': is not on this machine"):
        surgery.quantize(model, **METHODS["gptq"], calibration=CALIBRATION, onload="cuda:99")
    with pytest.raises(surgery.ConfigError, match=r"^quantize\.onload='cpu': .*method='rtn' calibrates no blocks"):
        surgery.quantize(model, **METHODS["rtn"], onload="cpu")
    with pytest.raises(
        surgery.ConfigError, match=r"^prune\.onload='cpu': .*'l1_unstructured' with scope='layer' calibrates no blocks"
    ):
        surgery.prune(model, 0.5, onload="cpu")
    with pytest.raises(surgery.ConfigError, match=r"^prune\.onload='tpu': must be cpu, cuda, cuda:N or mps$"):
        surgery.prune(model, 0.5, method="wanda", calibration=CALIBRATION, onload="tpu")
    with pytest.raises(surgery.ConfigError, match=r"^quantize\.onload='cpu': moves each repeated block .* has none"):
        surgery.quantize(model, **METHODS["gptq"], calibration=CALIBRATION, onload="cpu", blocks=False)
    with pytest.raises(surgery.ConfigError, match=r"^prune\.onload='cpu': moves each repeated block .* has none"):
        surgery.prune(
            torch.nn.Sequential(torch.nn.Linear(4, 4)),
            0.5,
            method="wanda",
            calibration=[torch.randn(2, 4)],
            onload="cpu",
        )
    assert_no_hooks(model)
    tiny_llama(layers=1).save_pretrained(tmp_path / "model")
    with surgery.offloaded(tmp_path / "model") as offloaded:
        with pytest.raises(
            surgery.ConfigError, match=r"^quantize\.onload='cpu': an offloaded model .*offloaded\(device=\)"
        ):
            surgery.quantize(offloaded, **METHODS["gptq"], calibration=CALIBRATION, onload="cpu")
        with pytest.raises(surgery.ConfigError, match=r"^prune\.onload='cpu': an offloaded model brings each block"):
            surgery.prune(offloaded, 0.5, method="wanda", calibration=CALIBRATION, onload="cpu")


VERBS = {
    **{
        name: (lambda m, b, spec=spec: surgery.quantize(m, **spec, calibration=b, exclude="lm_head"))
        for name, spec in METHODS.items()
    },
    "wanda": lambda m, b: surgery.prune(m, 0.5, method="wanda", calibration=b, exclude="lm_head"),
    "sparsegpt": lambda m, b: surgery.prune(m, 0.5, method="sparsegpt", calibration=b, exclude="lm_head"),
    "awq": lambda m, b: surgery.awq(m, weights=GridSpec(bits=4, group_size=32), calibration=b, progress=False),
}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("verb", list(VERBS))
def test_every_verb_keeps_a_half_precision_model_in_its_dtype_on_its_device(device, dtype, verb):
    # found by trying: AWQ's clip search started from 1e9, which float16 cannot hold
    model = tiny_llama(layers=2, dtype=dtype).to(device)
    batches = [batch.to(device) for batch in CALIBRATION]
    with VERBS[verb](model, batches):
        assert held_on(model, device) and {p.dtype for p in model.parameters()} == {dtype}
        with torch.no_grad():
            assert torch.isfinite(model(IDS.to(device)).logits).all()


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_a_half_precision_model_exports_to_compressed_tensors_bit_for_bit(device, dtype, tmp_path):
    import transformers

    from surgery import ExportParityError

    tiny_llama(layers=2).save_pretrained(tmp_path / "float")
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "float", dtype=dtype).to(device).eval()
    weights = GridSpec(bits=4, group_size=32, symmetric=True)
    with surgery.quantize(model, weights=weights, exclude="lm_head") as handle:
        record = surgery.export(handle, tmp_path / "m", format="compressed-tensors", inputs=[IDS.to(device)])
    assert record.parity.equal, record.parity  # scales stored in the model's dtype, as the simulation rounds them
    cast = tiny_llama(layers=2).to(device=device, dtype=dtype)  # .to() casts the rotary inv_freq as well
    with surgery.quantize(cast, weights=weights, exclude="lm_head") as handle:
        with pytest.raises(ExportParityError, match=r"the model's buffer model\.rotary_emb\.inv_freq is "):
            surgery.export(handle, tmp_path / "again", format="compressed-tensors", inputs=[IDS.to(device)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_onnx_refuses_a_half_precision_model_in_one_line(dtype, tmp_path):
    from surgery.core.errors import ConfigError

    model = tiny_llama(layers=1, dtype=dtype)
    weights = GridSpec(bits=4, group_size=32, symmetric=True)
    with surgery.quantize(model, weights=weights, exclude="lm_head", target="onnx") as handle:
        name = str(dtype).removeprefix("torch.")
        with pytest.raises(
            ConfigError, match=rf"^export\.format='onnx': writes float32 graphs .*this model is {name}:"
        ):
            surgery.export(handle, tmp_path / "m.onnx", format="onnx", inputs=[IDS])
    assert not list(tmp_path.iterdir())


@pytest.mark.slow  # ~15 s: a run with its checks and the compressed-tensors deploy check
@pytest.mark.parametrize("device", devices())
def test_a_bfloat16_run_exports_compressed_tensors_bit_for_bit(device, tmp_path):
    from support import run_recipe

    args = ("recipe=quantize_gptq_llama", "data.batches=1", f"model.device={device}", "model.dtype=bfloat16")
    report = run_recipe(tmp_path, *args, "export.format=compressed-tensors")
    assert report["ok"] and report["deploy"]["max_abs"] == 0.0  # built as from_pretrained builds it: rotary float32
