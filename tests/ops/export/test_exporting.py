"""surgery.export: the file its own runtime loads computes what the model under surgery
computes, and what a format cannot hold is said, not dropped silently."""

from __future__ import annotations

import copy
import gc
import logging

import pytest
import torch
from torch import nn

import surgery
from surgery.core.errors import ConfigError, ConfigTypeError, OutputExistsError, OutputWriteError
from surgery.core.handles import attached_to


def test_a_hugging_face_model_loads_the_export_with_from_pretrained_and_gives_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 64, (2, 12))
    spec = surgery.QuantizeSpec(weights=surgery.GridSpec(bits=4, symmetric=True, per_channel=True))
    with surgery.quantize(model, spec) as handle:
        expected = model(ids).logits
        config.save_pretrained(tmp_path)
        record = surgery.export(handle, tmp_path / "model.safetensors")
    assert record.left_out == [] and record.bytes == (tmp_path / "model.safetensors").stat().st_size
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, local_files_only=True).eval()
    assert torch.equal(loaded(ids).logits, expected)


def test_a_timm_model_loads_the_export_strictly_and_gives_the_same_outputs(tmp_path):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("resnet10t", pretrained=False, num_classes=10).eval()
    x = torch.randn(2, 3, 64, 64)
    with surgery.prune(model, surgery.PruneSpec(0.5, method="ln_structured")) as handle:
        expected = model(x)
        record = surgery.export(handle, tmp_path / "pruned.safetensors")
    fresh = timm.create_model("resnet10t", pretrained=False, num_classes=10).eval()
    fresh.load_state_dict(record.load(), strict=True)
    assert torch.equal(fresh(x), expected)


def test_what_a_weights_file_cannot_hold_is_logged_and_listed(tmp_path, caplog):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    batches = [torch.randn(4, 8) for _ in range(2)]
    with surgery.quantize(model, activations=surgery.GridSpec(bits=8), calibration=batches, progress=False) as h:
        with caplog.at_level(logging.WARNING, logger="surgery"):
            record = surgery.export(h, tmp_path / "w8a8.safetensors")
    assert record.left_out == ["activation quantization of 2 layer(s) (save_qparams keeps its parameters)"]
    assert record.as_dict()["left_out"] == record.left_out
    assert "holds the weights only; not in w8a8.safetensors: activation quantization" in caplog.text


def test_bad_export_arguments_are_one_line_and_write_nothing(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4))
    before = model[0].weight.detach().clone()
    with pytest.raises(ConfigError, match=r"^export.format='onnxx': must be one of safetensors"):
        surgery.export(model, tmp_path / "m.onnx", format="onnxx")
    with pytest.raises(ConfigError, match=r"^export.path='.*m.pt': must end in .safetensors"):
        surgery.export(model, tmp_path / "m.pt")
    with pytest.raises(ConfigError, match=r"^export.options=\['opset'\]: format='safetensors' takes no options"):
        surgery.export(model, tmp_path / "m.safetensors", opset=17)
    assert list(tmp_path.iterdir()) == [] and torch.equal(model[0].weight, before)
    surgery.export(model, tmp_path / "m.safetensors")
    with pytest.raises(OutputExistsError):
        surgery.export(model, tmp_path / "m.safetensors")


def test_a_weight_method_whose_answer_is_missing_or_broken_is_refused_and_the_model_kept():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    before = [p.detach().clone() for p in model.parameters()]
    answers = {
        "forgets": lambda problem: {},
        "zero_scale": lambda problem: {
            key: surgery.QuantizedWeight(torch.tensor(0.0), torch.tensor(0, dtype=torch.int32), None)
            for key in problem.targets.matched
        },
    }
    messages = {
        "forgets": r"^quantize.method='forgets': returned no QuantizedWeight for 0.weight \(got NoneType\)$",
        "zero_scale": r"^quantize.method='zero_scale': 0.weight.scale holds 0.0; every scale must be",
    }
    try:
        for name, solve in answers.items():
            surgery.register_weight_method(name, solve)
            with pytest.raises(ConfigError, match=messages[name]):
                surgery.quantize(model, weights=surgery.GridSpec(), method=name)
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    finally:
        from surgery.ops.numerics.weight_methods import WEIGHT_METHODS

        for name in answers:
            WEIGHT_METHODS.unregister(name)


def _run_pickled(deployable, call):
    return surgery.ops.export.format_table.run_module(deployable, call)


@pytest.fixture
def pickled():
    """A runnable test format: the model (hooks and all) pickled after ``edit`` changed a copy of it."""
    edits = {}

    def write(model, path, options):
        changed = copy.deepcopy(model)
        edits.get("edit", lambda m: None)(changed)
        torch.save(changed, path)

    load = lambda path: torch.load(path, weights_only=False)  # noqa: E731
    surgery.register_export_format(
        surgery.ExportFormat("test_pickled", write, load=load, suffix="pt", holds_hooks=True, run=_run_pickled)
    )
    yield edits
    surgery.ops.export.exporting.EXPORT_FORMATS.unregister("test_pickled")


class Classes(nn.Module):
    """Two near-tied class scores and their argmax: an integer output beside a floating one."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.offset = nn.Parameter(torch.zeros(2, 2))  # a NaN put here reaches the scores
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(2))
            self.fc.bias.zero_()

    def forward(self, x):
        scores = self.fc(x) + self.offset[0]
        return scores, scores.argmax(-1)


def near_ties() -> torch.Tensor:
    return 100 + torch.randn(64, 2, generator=torch.Generator().manual_seed(0))


def test_integer_outputs_are_compared_and_a_missed_promise_writes_nothing(tmp_path, pickled):
    model, x = Classes(), near_ties()
    pickled["edit"] = lambda m: m.fc.bias.data.add_(torch.tensor([0.5, 0.0]))  # scores cosine > 0.9999
    (tmp_path / "m.pt").write_text("earlier")
    with pytest.raises(surgery.ExportParityError, match=r"^export.format='test_pickled': .*integer outputs agree on"):
        surgery.export(model, tmp_path / "m.pt", format="test_pickled", inputs=[x], overwrite=True)
    assert (tmp_path / "m.pt").read_text() == "earlier"  # the failed artifact never replaced it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.pt"]
    try:
        surgery.export(model, tmp_path / "n.pt", format="test_pickled", inputs=[x])
    except surgery.ExportParityError as err:
        found = err.record.parity
    assert found.cosine > 0.9999 and found.agreement < 0.9 and not found.holds
    pickled["edit"] = lambda m: None
    record = surgery.export(model, tmp_path / "n.pt", format="test_pickled", inputs=[x])
    assert record.parity.agreement == 1.0 and record.parity.equal and record.parity.holds


@pytest.mark.parametrize("side", ["model", "artifact"])
def test_nan_on_either_side_fails_the_promise(tmp_path, pickled, side):
    model, x = Classes(), near_ties()
    nan = lambda m: m.offset.data[0, 0].fill_(float("nan"))  # noqa: E731
    if side == "model":
        nan(model)
        pickled["edit"] = lambda m: m.offset.data.zero_()
    else:
        pickled["edit"] = nan
    with pytest.raises(surgery.ExportParityError) as raised:
        surgery.export(model, tmp_path / "m.pt", format="test_pickled", inputs=[x])
    parity = raised.value.record.parity
    expected = "the model under surgery" if side == "model" else "the artifact"
    assert parity.nonfinite == (expected,) and parity.max_abs == float("inf") and not parity.holds
    assert list(tmp_path.iterdir()) == []


def test_surgery_another_handle_keeps_outside_the_weights_is_refused_or_listed(tmp_path):
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(4, 16)
    spec = surgery.QuantizeSpec(weights=surgery.GridSpec(bits=8, symmetric=True, per_channel=True))
    with surgery.rewrite_inputs(model, lambda args, kwargs: ((args[0] * 2,), kwargs)):
        with surgery.quantize(model, spec) as handle:
            with pytest.raises(ConfigError, match=r"^export.handle='rewrite handle': is also attached to the model"):
                surgery.export(handle, tmp_path / "m.pt", format="torchao", inputs=[x])
            record = surgery.export(handle, tmp_path / "w.safetensors")
            plain = surgery.export(model, tmp_path / "p.safetensors")
    assert record.left_out == ["input rewrites (attached by another handle, rewrite)"] and not record.exact
    assert plain.left_out == ["input rewrites"]  # the model itself: every handle on it is its surgery
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.safetensors", "w.safetensors"]


def test_surgery_whose_handle_nobody_kept_is_refused_by_name(tmp_path):
    """Hostile pass, wave 4, item 1: a rewrite attached as a statement was invisible to export
    (written, ``left_out=[]``, cosine 0.96 to the model under surgery)."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(4, 16)
    surgery.rewrite_inputs(model, lambda args, kwargs: ((args[0] * 2,), kwargs))  # the handle is not kept
    gc.collect()
    spec = surgery.QuantizeSpec(weights=surgery.GridSpec(bits=8, symmetric=True, per_channel=True))
    with surgery.quantize(model, spec) as handle:
        gc.collect()
        with pytest.raises(ConfigError, match=r"^export.handle='rewrite handle': is also attached to the model"):
            surgery.export(handle, tmp_path / "m.pt", format="torchao", inputs=[x])
        assert surgery.export(model, tmp_path / "p.safetensors").left_out == ["input rewrites"]
    for each in attached_to(model):
        each.restore()


def test_an_online_rotation_another_handle_keeps_is_refused_by_name(tmp_path):
    pytest.importorskip("transformers")
    from support import tiny_llama  # tests/support.py

    model = tiny_llama(layers=2)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    spec = surgery.QuantizeSpec(weights=surgery.GridSpec(bits=8, symmetric=True, per_channel=True))
    with surgery.rotate(model, calibration=[ids], online=True) as rotated, surgery.quantize(model, spec) as handle:
        assert rotated.online  # a hook before down_proj: outside the weights
        with pytest.raises(ConfigError, match=r"^export.handle='rotate handle': .*online Hadamard before 2 layer"):
            surgery.export(handle, tmp_path / "m.pt", format="torchao", inputs=[ids])
    assert list(tmp_path.iterdir()) == []


def _zeroed(model: nn.Module) -> nn.Module:
    changed = copy.deepcopy(model)
    for param in changed.parameters():
        nn.init.zeros_(param)
    return changed


def test_equal_outputs_hold_a_cosine_promise_even_when_they_are_all_zero(tmp_path):
    """Two all-zero outputs have cosine 0: equal outputs must still keep a cosine promise, and
    an artifact that is zero where the model is not must still miss it."""
    load = lambda path: torch.load(path, weights_only=False)  # noqa: E731
    write = lambda model, path, options: torch.save(_zeroed(model), path)  # noqa: E731
    surgery.register_export_format(
        surgery.ExportFormat(
            "test_zeroing", write, load=load, suffix="pt", holds_hooks=True, exact=False, run=_run_pickled
        )
    )
    try:
        model = _zeroed(nn.Linear(4, 3))
        record = surgery.export(model, tmp_path / "z.pt", format="test_zeroing", inputs=[torch.randn(2, 4)])
        assert record.parity.equal and record.parity.holds
        nn.init.ones_(model.bias)  # the model's output is no longer zero; the artifact's still is
        with pytest.raises(surgery.ExportParityError):
            surgery.export(model, tmp_path / "o.pt", format="test_zeroing", inputs=[torch.randn(2, 4)])
        assert sorted(p.name for p in tmp_path.iterdir()) == ["z.pt"]
    finally:
        surgery.ops.export.exporting.EXPORT_FORMATS.unregister("test_zeroing")


def test_a_path_that_cannot_be_written_is_one_line_naming_export_path_and_leaves_nothing(tmp_path):
    (tmp_path / "folder.safetensors").mkdir()
    (tmp_path / "a_file").write_text("x")
    model = nn.Sequential(nn.Linear(8, 8))
    with surgery.prune(model, 0.5) as handle:
        with pytest.raises(OutputWriteError, match=r"^export.path='.*folder.safetensors': cannot be written \(Is a"):
            surgery.export(handle, tmp_path / "folder.safetensors", overwrite=True)
        with pytest.raises(OSError, match=r"^export.path='.*a_file/m.safetensors': cannot be written"):
            surgery.export(handle, tmp_path / "a_file" / "m.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "folder.safetensors"]


def test_export_inputs_the_model_cannot_take_are_one_line_and_leave_nothing(tmp_path):
    pytest.importorskip("torchao")
    model = nn.Sequential(nn.Linear(8, 8)).eval()
    with surgery.quantize(model, weights=surgery.GridSpec(per_channel=True), activations=None, target="torchao") as h:
        with pytest.raises(ConfigError, match=r"^export.inputs='batch 0': Sequential fails on it \(RuntimeError: mat1"):
            surgery.export(h, tmp_path / "m.pt", format="torchao", inputs=torch.ones(2, 5))
    assert list(tmp_path.iterdir()) == []


def test_a_writer_that_fails_unexpectedly_is_one_line_naming_the_format_and_leaves_nothing(tmp_path):
    def broken(model, path, options):
        path.write_bytes(b"half")
        raise KeyError("surprise")

    chosen = surgery.ExportFormat("broken_for_test", broken, load=lambda p: None, suffix="bin")
    surgery.register_export_format(chosen, replace=True)
    with pytest.raises(ConfigError, match=r"^export.format='broken_for_test': cannot write Linear \(KeyError: 'surp"):
        surgery.export(nn.Linear(2, 2), tmp_path / "m.bin", format="broken_for_test")
    assert list(tmp_path.iterdir()) == []


def test_a_format_registered_with_the_old_takes_plan_gets_the_export_parts_and_warns(tmp_path):
    from surgery.ops.numerics.deployment import ExportParts

    given = []

    def write(parts, path, options):
        given.append(parts)
        path.write_bytes(b"x")

    with pytest.deprecated_call(match=r"takes_plan=\) is now takes_parts="):
        chosen = surgery.register_export_format(
            "test_takes_plan", write, load=lambda path: None, suffix="bin", takes_plan=True
        )
    try:
        assert chosen.takes_parts
        model = nn.Sequential(nn.Linear(4, 3))
        with surgery.prune(model, 0.5) as handle:
            surgery.export(handle, tmp_path / "m.bin", format="test_takes_plan")
        assert type(given[0]) is ExportParts and list(given[0].masks) == ["0.weight"]
    finally:
        surgery.ops.export.exporting.EXPORT_FORMATS.unregister("test_takes_plan")


def test_a_failed_reload_leaves_the_target_as_it_was_and_says_why_in_one_line(tmp_path):
    """The written folder is reloaded before it is moved into place: transformers failing to
    load it leaves an earlier folder at the path untouched, and the error is one line."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("compressed_tensors")
    from unittest import mock

    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, vocab_size=64
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    target = tmp_path / "llama"
    target.mkdir()
    (target / "keep.txt").write_text("earlier")
    broken = RuntimeError("We encountered some issues\nduring automatic conversion of the weights")
    spec = surgery.GridSpec(bits=4, symmetric=True, group_size=16)
    with surgery.quantize(model, weights=spec, select="**.*_proj", progress=False) as handle:
        with mock.patch.object(transformers.LlamaForCausalLM, "from_pretrained", side_effect=broken):
            with pytest.raises(ConfigError) as caught:
                surgery.export(
                    handle, target, format="compressed-tensors", inputs=[torch.randint(0, 64, (1, 8))], overwrite=True
                )
    assert str(caught.value) == (
        "export.format='compressed-tensors': its runtime cannot load the written LlamaForCausalLM "
        "(RuntimeError: We encountered some issues); nothing was written"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["llama"] and [p.name for p in target.iterdir()] == ["keep.txt"]


@pytest.fixture(scope="module")
def group_ordered():
    """A one-block Llama quantized by GPTQ with ``actorder="group"`` (its weights carry a g_idx)."""
    from support import tiny_llama, token_batches  # tests/support.py

    model = tiny_llama(layers=1, vocab=64, hidden=64)
    spec = surgery.GridSpec(bits=4, group_size=16)
    handle = surgery.quantize(
        model,
        weights=spec,
        method={"name": "gptq", "actorder": "group"},
        calibration=token_batches(2),
        exclude="lm_head",
        progress=False,
    )
    yield handle, token_batches(1)
    handle.restore()


@pytest.mark.parametrize("name", ["compressed-tensors", "onnx", "torchao", "fp8", "sparse"])
def test_a_format_without_a_group_index_refuses_a_group_ordered_weight_in_one_line(group_ordered, tmp_path, name):
    handle, batches = group_ordered
    suffix = surgery.ops.export.exporting.EXPORT_FORMATS.get(name).suffix
    path = tmp_path / (f"out.{suffix}" if suffix else "out")
    with pytest.raises(ConfigError, match=r"cannot hold model\.layers\.0\.\S+'s group index \(g_idx") as err:
        surgery.export(handle, path, format=name, inputs=batches)
    assert "\n" not in str(err.value) and f"export.format={name!r}" in str(err.value)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_format_holding_a_group_index_gets_it_and_safetensors_writes_the_weights_it_computes(group_ordered, tmp_path):
    handle, _ = group_ordered
    seen = {}

    def write(parts, path, options):
        seen.update(parts.weights)
        path.write_bytes(b"")

    surgery.register_export_format(
        surgery.ExportFormat("test_g_idx", write, load=lambda p: None, suffix="bin", takes_parts=True, holds_g_idx=True)
    )
    try:
        surgery.export(handle, tmp_path / "out.bin", format="test_g_idx")
    finally:
        surgery.ops.export.exporting.EXPORT_FORMATS.unregister("test_g_idx")
    key = "model.layers.0.mlp.down_proj.weight"
    grid, weight = seen[key], handle.model.get_parameter(key).detach()
    assert torch.equal(grid.g_idx, handle.weights[key].g_idx)
    assert torch.equal(grid.dequantized(grid.integers(weight)), weight)  # the integers on the scattered groups
    record = surgery.export(handle, tmp_path / "w.safetensors")
    assert torch.equal(record.load()[key], weight)


def test_a_parity_check_too_short_for_the_model_s_sliding_window_does_not_vouch_for_it(tmp_path):
    """Hostile pass, wave 4, item 2: a check on 8-token (or 128-byte) inputs said 1.0 for a model
    whose 8-token (160-token) window it never exercised."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    config.vocab_size, config.max_position_embeddings, config.sliding_window = 64, 64, 8
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    short, long = (torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(0)) for n in (8, 9))
    spec = surgery.QuantizeSpec(weights=surgery.GridSpec(bits=8, symmetric=True, per_channel=True), exclude="lm_head")
    with surgery.quantize(model, spec) as handle:
        with pytest.raises(
            surgery.ExportParityError,
            match=r"^export.inputs: the compressed-tensors artifact matched the model under surgery on them .* but the check cannot vouch: .* at most 8 tokens .*sliding_window=8",
        ):
            surgery.export(handle, tmp_path / "short", format="compressed-tensors", inputs=[short])
        record = surgery.export(handle, tmp_path / "long", format="compressed-tensors", inputs=[short, long])
    assert record.parity.holds and "unreached" not in record.parity.as_dict()
    assert not (tmp_path / "short").exists()


def test_a_copy_of_a_model_under_surgery_is_refused_or_listed_and_an_orphan_handle_is_named(tmp_path):
    """Found by the wave-4 hostile pass: a deepcopy runs its original's hooks, which no handle owns,
    and export took it for a plain model; a handle whose model was freed was 'not a handle'."""
    pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    surgery.rewrite_inputs(model, lambda args, kwargs: ((args[0] * 2,), kwargs))
    copied = copy.deepcopy(model)
    assert surgery.attached_to(copied) == [] and len(copied._forward_pre_hooks) == 1
    plain = surgery.export(copied, tmp_path / "p.safetensors")
    assert plain.left_out == ["input rewrites (copied with the model from one under rewrite; no handle owns it)"]
    spec = surgery.QuantizeSpec(weights=surgery.GridSpec(bits=8, symmetric=True, per_channel=True))
    with surgery.quantize(copied, spec) as handle:
        listed = surgery.export(handle, tmp_path / "q.safetensors")
        refused = r"^export.handle='input rewrites \(copied .*: export the original, or bake"
        with pytest.raises(ConfigError, match=refused):
            surgery.export(handle, tmp_path / "q.pt", format="torchao", inputs=[torch.randn(2, 16)])
    assert listed.left_out == plain.left_out and not listed.exact
    for each in surgery.attached_to(model):
        each.restore()
    orphan = surgery.quantize(nn.Sequential(nn.Linear(8, 8)), spec)
    gc.collect()
    with pytest.raises(ConfigError, match=r"^export.handle='quantize': its model no longer exists"):
        surgery.export(orphan, tmp_path / "o.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.safetensors", "q.safetensors"]


def test_padding_is_no_position_a_sliding_window_reaches():
    from surgery.core.inputs import as_call
    from surgery.ops.export.positions import tokens_of

    mask = torch.zeros(2, 20, dtype=torch.long)
    mask[0, :4], mask[1, :6] = 1, 1
    assert tokens_of(as_call({"input_ids": torch.zeros(2, 20, dtype=torch.long), "attention_mask": mask})) == 6
    assert tokens_of(as_call({"inputs_embeds": torch.zeros(1, 9, 4)})) == 9
    assert tokens_of(as_call(torch.zeros(3, 7, dtype=torch.long))) == 7


def test_the_keyword_form_of_register_export_format_still_works_and_warns():
    def write(model, path, options):
        torch.save(model.state_dict(), path)

    with pytest.warns(DeprecationWarning, match=r"is now register_export_format\(ExportFormat\(name, write"):
        chosen = surgery.register_export_format("test_keywords", write, load=torch.load, suffix="pt")
    try:
        assert isinstance(chosen, surgery.ExportFormat) and chosen.suffix == "pt"
        with pytest.raises(ConfigTypeError, match=r"^register_export_format='sufix': unknown setting"):
            surgery.register_export_format("test_keywords2", write, load=torch.load, sufix="pt")
        with pytest.raises(ConfigTypeError, match=r"takes an ExportFormat alone"):
            surgery.register_export_format(chosen, write)
    finally:
        surgery.ops.export.format_table.EXPORT_FORMATS.unregister("test_keywords")
