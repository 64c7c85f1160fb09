"""Verbs on an offloaded model, block by block: the result equals the same verb on the model in
memory, baked, bit for bit; the source files never change; export streams it; a run that died
part-way starts again; a full disk leaves the output as it was."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import memory_probe as memory_probe_module  # tests/memory_probe.py
import pytest
import torch
from safetensors.torch import load_file
from support import exit_code_of_a_child, tiny_llama, tiny_moe  # tests/support.py
from torch import nn

import surgery
from surgery import GridSpec
from surgery.core._compat import global_hook_counts
from surgery.core.errors import AlreadyModifiedError, ConfigError
from surgery.ops.export.formats.compressed_tensors_folder import load_compressed_tensors

GPTQ = GridSpec(bits=4, group_size=32)


def llama_folder(folder: Path, layers: int = 3) -> nn.Module:
    model = tiny_llama(layers=layers, vocab=128)
    model.save_pretrained(folder)
    return model


def batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 16), generator=generator) for _ in range(4)]


TOKENS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(2))


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS).logits


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


VERBS = {
    "gptq": lambda m, cal, **kw: surgery.quantize(
        m, weights=GPTQ, method="gptq", calibration=cal, progress=False, **kw
    ),
    "rtn": lambda m, cal, **kw: surgery.quantize(m, weights=GridSpec(bits=4, group_size=32), progress=False, **kw),
    "sparsegpt": lambda m, cal, **kw: surgery.prune(m, 0.5, method="sparsegpt", calibration=cal, progress=False, **kw),
    "wanda": lambda m, cal, **kw: surgery.prune(m, 0.5, method="wanda", calibration=cal, progress=False, **kw),
    "magnitude": lambda m, cal, **kw: surgery.prune(m, 0.5, progress=False, **kw),
    "smoothquant": lambda m, cal, **kw: surgery.smooth(m, 0.8, calibration=cal, progress=False, **kw),
}


@pytest.mark.parametrize("verb", list(VERBS))
def test_a_verb_on_the_offloaded_model_equals_it_in_memory_and_restores_from_untouched_files(tmp_path, verb):
    reference = llama_folder(tmp_path)
    before_files, before_hooks = digest(tmp_path), global_hook_counts()
    original = logits(reference)
    VERBS[verb](reference, batches()).bake()
    source = surgery.offloaded(tmp_path)
    done = VERBS[verb](source, batches())
    assert torch.equal(logits(source.model), logits(reference))
    assert all(p.is_meta for p in source.model.parameters())  # held a block at a time, never whole
    assert done.blocks == 3 and len(done.seconds) == len(done.stages)
    assert digest(tmp_path) == before_files
    assert global_hook_counts() == before_hooks  # the verbs' hooks went with each block's bake
    done.restore()
    assert torch.equal(logits(source.model), original)
    assert not done.work.exists()  # the temporary stage files go with restore


def test_sensitivity_of_an_offloaded_model_equals_it_in_memory(tmp_path):
    reference = llama_folder(tmp_path, layers=2)
    inputs = batches()[:2]
    kwargs = {"calibration": inputs, "select": "model.layers.*.mlp.*", "progress": False}
    expected = surgery.sensitivity(reference, (0.5,), **kwargs)
    source = surgery.offloaded(tmp_path)
    found = surgery.sensitivity(source, (0.5,), **kwargs)
    assert [(r.layer, r.score) for r in found.rows] == [(r.layer, r.score) for r in expected.rows]
    assert source.overlay == {}  # every trial restored
    assert torch.equal(logits(source.model), logits(reference))


def test_export_streams_the_same_files_as_the_model_in_memory_gives(tmp_path):
    folder, out = tmp_path / "model", tmp_path / "out"
    reference = llama_folder(folder)
    select = "model.layers.*.*.*"  # compressed-tensors holds Linear layers of one scheme; the head stays float
    in_memory = surgery.quantize(
        reference, weights=GPTQ, method="gptq", calibration=batches(), select=select, progress=False
    )
    surgery.export(in_memory, out / "memory", format="compressed-tensors")
    surgery.export(in_memory, out / "memory.safetensors")
    done = surgery.quantize(
        surgery.offloaded(folder), weights=GPTQ, method="gptq", calibration=batches(), select=select
    )
    record = surgery.export(done, out / "offloaded", format="compressed-tensors", inputs=[TOKENS])
    surgery.export(done, out / "offloaded.safetensors")
    assert record.parity.equal  # transformers loads the folder and computes what the offloaded model does
    expected, found = load_file(out / "memory.safetensors"), load_file(out / "offloaded.safetensors")
    assert expected.keys() == found.keys() and all(torch.equal(expected[k], found[k]) for k in expected)
    shards = sorted((out / "offloaded").glob("model-*.safetensors"))
    assert len(shards) == 5  # embeddings, a shard per block, then the norm and the head
    expected = load_file(out / "memory" / "model.safetensors")
    found = {k: v for shard in shards for k, v in load_file(shard).items()}
    assert expected.keys() == found.keys() and all(torch.equal(expected[k], found[k]) for k in expected)
    config = json.loads((out / "offloaded" / "config.json").read_text())
    assert config == json.loads((out / "memory" / "config.json").read_text())
    assert config["quantization_config"]["format"] == "pack-quantized"
    assert torch.equal(logits(load_compressed_tensors(out / "offloaded")), logits(done.model))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])  # Q4_1: float offsets, saved and read back as floats
def test_gguf_streams_the_same_tensors_as_the_model_in_memory_gives(tmp_path, kind):
    gguf = pytest.importorskip("gguf")
    folder = tmp_path / "model"
    reference = llama_folder(folder)
    spec = GridSpec(bits=4)
    target = f"gguf:{kind}"
    in_memory = surgery.quantize(
        reference, weights=spec, method="gptq", target=target, calibration=batches(), exclude="lm_head"
    )
    surgery.export(in_memory, tmp_path / "memory.gguf", format="gguf")
    done = surgery.quantize(
        surgery.offloaded(folder), weights=spec, method="gptq", target=target, calibration=batches(), exclude="lm_head"
    )
    if kind == "Q4_1":
        with pytest.raises(
            ConfigError, match=r"stores integer zero points; every quantized weight's groups have float"
        ):
            surgery.export(done, tmp_path / "offloaded", format="compressed-tensors")
    record = surgery.export(done, tmp_path / "offloaded.gguf", format="gguf", inputs=[TOKENS])
    assert record.parity.equal  # transformers' GGUF loader computes what the offloaded model does
    read = [gguf.GGUFReader(str(tmp_path / f"{name}.gguf")).tensors for name in ("memory", "offloaded")]
    assert [(t.name, t.tensor_type) for t in read[0]] == [(t.name, t.tensor_type) for t in read[1]]
    assert all(bytes(a.data) == bytes(b.data) for a, b in zip(*read))  # the same blocks, bit for bit


def test_a_mixture_of_experts_model_streams_its_stacked_experts_as_in_memory(tmp_path):
    # offloaded, the experts stay fused (their grids named per expert): each expert is split from
    # the fused tensor read from disk and packed on its own grid, the same blocks as in memory
    gguf = pytest.importorskip("gguf")
    from surgery.tasks.tinymoe import load_moe

    model = load_moe()  # the shipped Qwen3-MoE, 8 experts a layer
    model.save_pretrained(tmp_path / "model")
    generator = torch.Generator().manual_seed(1)
    calibration = [torch.randint(0, 256, (4, 64), generator=generator) for _ in range(4)]  # every expert routed to
    settings = dict(weights=GPTQ, method="gptq", target="gguf:Q4_0", calibration=calibration, exclude="lm_head")
    in_memory = surgery.quantize(model, **settings)
    surgery.export(in_memory, tmp_path / "memory.gguf", format="gguf")
    done = surgery.quantize(surgery.offloaded(tmp_path / "model"), **settings)
    record = surgery.export(done, tmp_path / "offloaded.gguf", format="gguf", inputs=[calibration[0][:1]])
    assert record.parity.equal
    read = [gguf.GGUFReader(str(tmp_path / f"{name}.gguf")).tensors for name in ("memory", "offloaded")]
    assert [(t.name, t.tensor_type) for t in read[0]] == [(t.name, t.tensor_type) for t in read[1]]
    assert all(bytes(a.data) == bytes(b.data) for a, b in zip(*read))
    stacked = {t.name: t.tensor_type.name for t in read[1] if "_exps" in t.name}
    assert len(stacked) == 6 and set(stacked.values()) == {"Q4_0"}  # two layers' gate, up and down stacks


def test_the_offloaded_model_itself_streams_to_safetensors(tmp_path):
    reference = llama_folder(tmp_path / "model")
    source = surgery.offloaded(tmp_path / "model")
    surgery.export(source, tmp_path / "copy.safetensors")
    written = load_file(tmp_path / "copy.safetensors")
    assert all(torch.equal(written[k], v) for k, v in reference.state_dict().items())


def test_a_run_that_died_part_way_goes_on_from_its_work_folder(tmp_path):
    folder, work = tmp_path / "model", tmp_path / "work"
    reference = llama_folder(folder)
    VERBS["gptq"](reference, batches()).bake()
    source = surgery.offloaded(folder)
    runs = []

    def die_in_the_third_blocks_stage(module, args):  # its first run is the tracing forward (trace_stages)
        runs.append(1)
        if len(runs) == 2:
            raise KeyboardInterrupt

    hook = source.model.model.layers[2].register_forward_pre_hook(die_in_the_third_blocks_stage)
    with pytest.raises(KeyboardInterrupt):
        VERBS["gptq"](source, batches(), work=work)
    hook.remove()
    assert source.overlay == {}  # the model reads its source again
    assert sorted(p.name for p in work.glob("stage-*")) == ["stage-00000.safetensors", "stage-00001.safetensors"]
    done = VERBS["gptq"](source, batches(), work=work)
    assert done.resumed == 2 and len(done.seconds) == 2  # two blocks skipped; block 3 and the head run
    assert torch.equal(logits(source.model), logits(reference))
    with pytest.raises(ConfigError, match="holds a run with other settings or calibration") as err:
        surgery.quantize(source, weights=GridSpec(bits=3), method="gptq", calibration=batches(), work=work)
    assert "\n" not in str(err.value)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="is a folder of other files"):
        VERBS["gptq"](source, batches(), work=tmp_path / "other")


def export_on_a_full_disk(folder: Path, out: Path) -> None:
    """Export the offloaded ``folder`` to ``out`` with files limited to 30 kB (run in a forked
    child, whose limits are its own): exit 3 if the export failed with an OSError."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as on a full disk
    source = surgery.offloaded(folder)
    resource.setrlimit(resource.RLIMIT_FSIZE, (30_000, 30_000))
    try:
        surgery.export(source, out, format="safetensors", overwrite=True)
    except OSError:
        os._exit(3)


def test_a_full_disk_while_streaming_leaves_the_output_as_it_was(tmp_path):
    llama_folder(tmp_path / "model")
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"the previous export")
    assert exit_code_of_a_child(lambda: export_on_a_full_disk(tmp_path / "model", out)) == 3
    assert out.read_bytes() == b"the previous export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "out.safetensors"]  # no partial file left


@pytest.mark.xdist_group("memory")
def test_offloaded_gptq_holds_a_few_blocks_not_the_model(tmp_path, memory_probe):
    """24 blocks of 8 MB: each stage holds its block, GPTQ's working copy and the file being
    written; the originals are read again from the files, the grids from the stage files
    (measured 0.31x, with the process's own growth; 0.5x before those two)."""
    path = str(tmp_path / "wide.safetensors")
    memory_probe_module.write(path)
    assert memory_probe.peak("gptq-offloaded", path) <= 0.4  # in memory the same run peaks above 1x


def test_a_timm_vision_transformer_is_quantized_offloaded_like_in_memory(tmp_path):
    timm = pytest.importorskip("timm")
    from safetensors.torch import save_file

    def build() -> nn.Module:
        torch.manual_seed(0)
        return timm.models.VisionTransformer(img_size=32, patch_size=8, embed_dim=64, depth=3, num_heads=2).eval()

    reference = build()
    save_file(reference.state_dict(), tmp_path / "vit.safetensors")
    images = [torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    surgery.quantize(reference, weights=GPTQ, method="gptq", calibration=images, progress=False).bake()
    source = surgery.offloaded(tmp_path / "vit.safetensors", factory=build)
    done = surgery.quantize(source, weights=GPTQ, method="gptq", calibration=images, progress=False)
    assert done.blocks == 3
    with torch.no_grad():
        assert torch.equal(source.model(images[0]), reference(images[0]))


@pytest.mark.parametrize(
    ("call", "field", "message"),
    [
        (
            lambda s: surgery.quantize(s, activations=GridSpec(bits=8), weights=None, calibration=batches()),
            "quantize.activations",
            "weights only",
        ),
        (lambda s: surgery.prune(s, 0.5, scope="global"), "prune.scope", "ranks across the whole model"),
        (lambda s: surgery.prune(s.model.model.layers[0], 0.5, work="w"), "prune.work", "is for an offloaded model"),
        (lambda s: surgery.export(s, "x.onnx", format="onnx"), "export.format", "formats that stream: safetensors"),
        (lambda s: surgery.quantize(s, weights=GPTQ, method="gptq"), "quantize.calibration", "calibration"),
    ],
    ids=["activations", "global-scope", "work-in-memory", "onnx", "no-calibration"],
)
def test_what_cannot_run_offloaded_is_one_line_and_changes_nothing(tmp_path, call, field, message):
    llama_folder(tmp_path)
    source = surgery.offloaded(tmp_path)
    with pytest.raises(ConfigError, match=message) as err:
        call(source)
    assert err.value.field == field and "\n" not in str(err.value)
    assert source.overlay == {} and all(p.is_meta for p in source.model.parameters())


def test_a_second_verb_restored_leaves_the_first_verbs_result(tmp_path):
    reference = llama_folder(tmp_path)
    source = surgery.offloaded(tmp_path)
    smoothed = VERBS["smoothquant"](source, batches())
    after_smoothing = logits(source.model)
    quantized = VERBS["gptq"](source, batches())
    VERBS["smoothquant"](reference, batches()).bake()
    VERBS["gptq"](reference, batches()).bake()
    assert torch.equal(logits(source.model), logits(reference))  # the second verb read the first's weights
    with pytest.raises(AlreadyModifiedError, match="restore that one first"):
        smoothed.restore()  # out of order: the first would put back weights the second rewrote
    assert torch.equal(logits(source.model), logits(reference))
    quantized.restore()
    assert torch.equal(logits(source.model), after_smoothing)
    smoothed.restore()
    assert source.overlay == {}


RTN = GridSpec(bits=4, group_size=32)


def rtn(source, work: Path):
    return surgery.quantize(source, weights=RTN, progress=False, work=work)


def test_a_work_folder_of_another_model_is_refused_not_resumed(tmp_path):
    """The same settings, the same shapes, another model's files: nothing of the first is published."""
    llama_folder(tmp_path / "a", layers=2)
    other = tiny_llama(layers=2, vocab=128)
    with torch.no_grad():
        for param in other.parameters():
            param.mul_(2)
    other.save_pretrained(tmp_path / "b")
    rtn(surgery.offloaded(tmp_path / "a"), tmp_path / "work")
    with pytest.raises(ConfigError, match=r"holds a run of other source files \(model.safetensors: its ") as err:
        rtn(surgery.offloaded(tmp_path / "b"), tmp_path / "work")
    assert "\n" not in str(err.value) and "fresh folder" in str(err.value)


def test_a_work_folder_of_a_verb_after_another_is_refused_for_that_verb_alone(tmp_path):
    """smooth then quantize, kept; quantize alone would adopt weights carrying the smoothing."""
    llama_folder(tmp_path / "model", layers=2)
    source = surgery.offloaded(tmp_path / "model")
    surgery.smooth(source, 0.8, calibration=batches(), progress=False, work=tmp_path / "smooth")
    rtn(source, tmp_path / "quantize")
    again = surgery.offloaded(tmp_path / "model")
    with pytest.raises(ConfigError, match="began from another state of the model"):
        rtn(again, tmp_path / "quantize")
    surgery.smooth(again, 0.8, calibration=batches(), progress=False, work=tmp_path / "smooth")
    assert rtn(again, tmp_path / "quantize").resumed == 3  # the same verbs in the same order do resume


def spoil(work: Path, how: str) -> None:
    """Edit a finished work folder's manifest or a stage file as a user (or a bad disk) might."""
    path = work / "manifest.json"
    manifest = json.loads(path.read_text())
    stages = manifest["stages"]
    if how == "stages-list":
        manifest["stages"] = list(stages.values())
    elif how == "outside":
        stages["0"]["file"] = "../x.safetensors"
    elif how == "other-layer":
        stages["0"]["names"], stages["0"]["grids"] = stages["1"]["names"], stages["1"]["grids"]
    elif how == "no-digest":
        del stages["1"]["sha256"]
    elif how == "grids-dropped":
        stages["1"]["grids"] = {}
    elif how == "zeroed":
        stage = work / stages["1"]["file"]
        stage.write_bytes(bytes(stage.stat().st_size))
    elif how == "not-json":
        path.write_bytes(b"\xff{")
        return
    elif how == "nested":
        path.write_text("[" * 100_000 + "]" * 100_000)
        return
    elif how.startswith("axis"):
        grids = stages["1"]["grids"]
        grids[next(iter(grids))] = {"axis-none": None, "axis-1": 1, "axis-huge": 10**30}[how]
    path.write_text(json.dumps(manifest))


SPOILED = {
    "stages-list": r"manifest.json': is not a manifest this surgery wrote \('stages' is list, not dict\)",
    "outside": r"stage 0's file is '../x.safetensors', not the plain name 'stage-00000.safetensors'",
    "other-layer": r"lists stage-00000.safetensors with other weights than model.layers.0's \(model.layers.0.",
    "no-digest": r"stage 1 has no sha256 of its file",
    "grids-dropped": r"stage-00001.safetensors': does not hold the stage's tensors as listed \(model.layers.1.",
    "zeroed": r"stage-00001.safetensors': is missing or not the file the run wrote",
    "not-json": r"manifest.json': cannot be read as JSON \(UnicodeDecodeError\)",
    "nested": r"manifest.json': cannot be read as JSON \(RecursionError\)",
    "axis-none": r"stage-00001.safetensors': lists axis None for model.layers.1.\S+, which its scales do not fit",
    "axis-1": r"stage-00001.safetensors': lists axis 1 for model.layers.1.\S+, which its scales do not fit",
    "axis-huge": r"stage-00001.safetensors': lists axis 10{30} for model.layers.1.\S+, which its scales do not fit",
}


@pytest.mark.parametrize("how", list(SPOILED))
def test_a_spoiled_work_folder_is_one_line_naming_it_and_what_is_wrong(tmp_path, how):
    llama_folder(tmp_path / "model", layers=2)
    rtn(surgery.offloaded(tmp_path / "model"), tmp_path / "work")
    spoil(tmp_path / "work", how)
    source = surgery.offloaded(tmp_path / "model")
    with pytest.raises(ConfigError, match=SPOILED[how]) as err:
        rtn(source, tmp_path / "work")
    assert "\n" not in str(err.value) and str(tmp_path / "work") in str(err.value)
    assert source.overlay == {}  # nothing adopted


def test_a_tokenizer_folder_is_saved_beside_the_export_and_a_broken_one_refused_before_writing(tmp_path):
    from support import local_tokenizer  # tests/support.py

    llama_folder(tmp_path / "model", layers=1)
    done = surgery.quantize(surgery.offloaded(tmp_path / "model"), weights=RTN, progress=False)
    tokenizer = local_tokenizer(tmp_path / "tokenizer", "surgery puts every change back exactly. " * 20, 40)
    surgery.export(done, tmp_path / "out", format="compressed-tensors", tokenizer=str(tokenizer))
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    (tokenizer / "tokenizer.json").write_text("{cut")
    with pytest.raises(ConfigError, match=r"export.options.tokenizer='.*/tokenizer.json': is not JSON") as err:
        surgery.export(done, tmp_path / "again", format="compressed-tensors", tokenizer=str(tokenizer))
    assert "\n" not in str(err.value) and not (tmp_path / "again").exists()


def test_a_work_folder_that_is_a_file_or_holds_a_cut_stage_is_named_as_work(tmp_path):
    folder, work = tmp_path / "model", tmp_path / "work"
    llama_folder(folder, layers=2)
    source = surgery.offloaded(folder)
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(ConfigError, match=r"^work='.*a_file': is a file; give a folder"):
        VERBS["rtn"](source, None, work=tmp_path / "a_file")
    VERBS["rtn"](source, None, work=work).restore()
    stage = work / "stage-00000.safetensors"
    stage.write_bytes(stage.read_bytes()[:100])
    with pytest.raises(
        ConfigError, match=r"^work='.*stage-00000.safetensors': is missing or not the file the run wrote"
    ):
        VERBS["rtn"](source, None, work=work)
    assert torch.equal(logits(source.model), logits(tiny_llama(layers=2, vocab=128)))


MOE_VERBS = {
    "gptq": lambda m, **kw: surgery.quantize(
        m, weights=GridSpec(bits=4, group_size=16), method="gptq", calibration=batches(), progress=False, **kw
    ),
    "rtn": lambda m, **kw: surgery.quantize(m, weights=GridSpec(bits=4, group_size=16), progress=False, **kw),
    "wanda": lambda m, **kw: surgery.prune(m, 0.5, method="wanda", calibration=batches(), progress=False, **kw),
}


@pytest.mark.parametrize(
    "family, verb", [("mixtral", "gptq"), ("mixtral", "rtn"), ("qwen3_moe", "gptq"), ("qwen3_moe", "rtn")]
)
def test_a_verb_on_an_offloaded_moe_folder_equals_it_in_memory_and_its_export_reloads(tmp_path, family, verb):
    """Each expert is a layer of its own (own grid, own Hessian) as in memory; the folder's experts are
    read under the per-expert names transformers saved them with; the export is fused and reloads."""
    folder, out = tmp_path / "model", tmp_path / "out"
    reference = tiny_moe(family, layers=2)
    reference.save_pretrained(folder)
    in_memory = MOE_VERBS[verb](reference)
    expert_layers = [k for k in in_memory.selection.matched if ".mlp.experts.3.down_proj" in k]
    assert len(expert_layers) == 2  # in both layers
    in_memory.bake()
    source = surgery.offloaded(folder)
    done = MOE_VERBS[verb](source)
    assert torch.equal(logits(source.model), logits(reference))
    state = source.model.state_dict(keep_vars=True)
    assert all(torch.equal(done.value_of(state[name]), value) for name, value in reference.state_dict().items())
    assert all(p.is_meta for p in source.model.parameters())
    surgery.export(done, out / "model.safetensors")
    source.model.config.save_pretrained(out)
    reloaded = type(reference).from_pretrained(out)
    assert torch.equal(logits(reloaded), logits(reference))
    done.restore()
    assert torch.equal(logits(source.model), logits(tiny_moe(family, layers=2)))


def test_an_offloaded_gpt_oss_folder_with_fused_names_is_pruned_like_in_memory_and_resumes(tmp_path):
    folder, work = tmp_path / "model", tmp_path / "work"
    reference = tiny_moe("gpt_oss", layers=2)
    reference.save_pretrained(folder)
    with surgery.every_expert_calibrated():  # these batches reach only some experts
        MOE_VERBS["wanda"](reference).bake()
        done = MOE_VERBS["wanda"](surgery.offloaded(folder), work=work)
        again = MOE_VERBS["wanda"](surgery.offloaded(folder), work=work)
    assert again.resumed == len(again.stages) == len(done.stages)
    for handle in (done, again):
        assert torch.equal(logits(handle.model), logits(reference))


CHECKPOINT_GATE = {  # the first expert's gate projection of the last layer, as each family's checkpoints name it
    "mixtral": "model.layers.1.block_sparse_moe.experts.0.w1",
    "qwen3_moe": "model.layers.1.mlp.experts.0.gate_proj",
}


W4_SYM = {  # compressed-tensors experts load symmetric weights
    "rtn": lambda m, **kw: surgery.quantize(
        m, weights=GridSpec(bits=4, symmetric=True, group_size=16), progress=False, **kw
    ),
    "gptq": lambda m, **kw: surgery.quantize(
        m,
        weights=GridSpec(bits=4, symmetric=True, group_size=16),
        method="gptq",
        calibration=batches(),
        progress=False,
        **kw,
    ),
}


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder's safetensors shards, by name."""
    return {key: value for file in sorted(folder.glob("*.safetensors")) for key, value in load_file(file).items()}


@pytest.mark.parametrize(
    "family, verb", [("mixtral", "rtn"), ("mixtral", "gptq"), ("qwen3_moe", "rtn"), ("qwen3_moe", "gptq")]
)
def test_the_streamed_compressed_tensors_export_of_an_offloaded_moe_equals_the_in_memory_one(tmp_path, family, verb):
    """Each expert's layers written per expert under the family's checkpoint names, from the grids its
    stage kept (read back by a resumed run): the tensors and config the in-memory export writes, and
    the same logits in transformers."""
    folder, out = tmp_path / "model", tmp_path / "out"
    reference = tiny_moe(family, layers=2)
    reference.save_pretrained(folder)
    with W4_SYM[verb](reference) as in_memory:
        surgery.export(in_memory, out / "memory", format="compressed-tensors")
    W4_SYM[verb](surgery.offloaded(folder), work=tmp_path / "work")
    done = W4_SYM[verb](surgery.offloaded(folder), work=tmp_path / "work")
    assert done.resumed == len(done.stages)  # every stage's grids read back from the work folder
    surgery.export(done, out / "streamed", format="compressed-tensors")
    memory, streamed = folder_tensors(out / "memory"), folder_tensors(out / "streamed")
    assert memory.keys() == streamed.keys() and f"{CHECKPOINT_GATE[family]}.weight_packed" in streamed
    assert all(memory[k].dtype == streamed[k].dtype and torch.equal(memory[k], streamed[k]) for k in memory)
    configs = [json.loads((out / name / "config.json").read_text()) for name in ("memory", "streamed")]
    assert configs[0]["quantization_config"] == configs[1]["quantization_config"]
    loaded = [load_compressed_tensors(out / name) for name in ("memory", "streamed")]
    assert torch.equal(logits(loaded[0]), logits(loaded[1]))


@pytest.mark.parametrize(
    ("family", "weights", "match"),
    [
        (
            "gpt_oss",
            GridSpec(bits=4, symmetric=True, group_size=16),
            r"^export.format='compressed-tensors': gpt_oss experts \(model",
        ),
        ("qwen3_moe", GridSpec(bits=4, group_size=16, symmetric=False), r"^quantize.weights.symmetric=False: .* zero"),
        ("qwen3_moe", GridSpec(format="nvfp4"), r"^quantize.weights.format='nvfp4': .* global scales"),
    ],
    ids=["gpt_oss_fused", "asymmetric", "nvfp4"],
)
def test_the_streamed_export_of_offloaded_experts_refuses_what_the_in_memory_one_does(tmp_path, family, weights, match):
    model = tiny_moe(family, hidden=64 if weights.is_float else 32)
    (model.to(torch.bfloat16) if weights.is_float else model).save_pretrained(tmp_path / "model")
    done = surgery.quantize(surgery.offloaded(tmp_path / "model"), weights=weights, progress=False)
    with pytest.raises(ConfigError, match=match) as err:
        surgery.export(done, tmp_path / "out", format="compressed-tensors")
    assert "\n" not in str(err.value) and sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert type(done.model.model.layers[0].mlp.experts) is type(model.model.layers[0].mlp.experts)  # fused again


def test_an_expert_grid_whose_axis_its_scales_do_not_fit_spoils_the_work_folder(tmp_path):
    tiny_moe("qwen3_moe", layers=1).save_pretrained(tmp_path / "model")
    W4_SYM["rtn"](surgery.offloaded(tmp_path / "model"), work=tmp_path / "work")
    manifest = json.loads((tmp_path / "work" / "manifest.json").read_text())
    stage = next(entry for entry in manifest["stages"].values() if "mlp.experts.2.down_proj.weight" in str(entry))
    stage["grids"]["model.layers.0.mlp.experts.2.down_proj.weight"] = 1
    (tmp_path / "work" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"lists axis 1 for model.layers.0.mlp.experts.2.down_proj.weight, which its"):
        W4_SYM["rtn"](surgery.offloaded(tmp_path / "model"), work=tmp_path / "work")


def test_gptaq_on_an_offloaded_model_is_refused_in_one_line_not_run_as_gptq(tmp_path):
    llama_folder(tmp_path / "model", layers=2)
    offloaded = surgery.offloaded(tmp_path / "model")
    with pytest.raises(ConfigError, match=r"quantize.method='gptaq'.*float model.*quantize in memory"):
        surgery.quantize(offloaded, weights=GridSpec(bits=4), method="gptaq", calibration=batches(), progress=False)


def test_gptq_in_group_order_on_an_offloaded_model_is_refused_in_one_line(tmp_path):
    llama_folder(tmp_path / "model", layers=2)
    offloaded = surgery.offloaded(tmp_path / "model")
    spec = GridSpec(bits=4, group_size=16)
    with pytest.raises(ConfigError, match=r"quantize.method.actorder='group'.*g_idx.*quantize in memory"):
        surgery.quantize(
            offloaded, weights=spec, method={"name": "gptq", "actorder": "group"}, calibration=batches(), progress=False
        )


def test_the_grids_are_read_from_the_stage_files_not_held_in_memory(tmp_path):
    """The handle's grids equal the in-memory run's; they live in the stage files only (the peak
    does not grow with depth): a stage file rewritten after the run is refused when a grid is read."""
    reference = llama_folder(tmp_path / "model")
    with surgery.quantize(
        reference, weights=GPTQ, method="gptq", calibration=batches(), exclude="lm_head", progress=False
    ) as memory:
        expected = {key: (q.scale, q.zero_point, q.axis) for key, q in memory.weights.items()}
    source = surgery.offloaded(tmp_path / "model")
    done = surgery.quantize(
        source,
        weights=GPTQ,
        method="gptq",
        calibration=batches(),
        exclude="lm_head",
        work=tmp_path / "work",
        progress=False,
    )
    assert sorted(done.grids) == sorted(expected) and len(done.grids) == len(expected)
    for key, (scale, zero_point, axis) in expected.items():
        found = done.grids[key]
        assert torch.equal(found[0], scale) and torch.equal(found[1], zero_point) and found[2] == axis
    stage = tmp_path / "work" / "stage-00001.safetensors"
    stage.write_bytes(stage.read_bytes())  # the same bytes, another file: its grids are no longer the run's
    key = next(k for k in done.grids if k.startswith("model.layers.1."))
    with pytest.raises(ConfigError, match="stage-00001.safetensors"):
        done.grids[key]


def test_the_first_block_s_inputs_are_caught_reading_the_embeddings_once_and_the_block_not_at_all(tmp_path):
    """The forward that catches the first block's inputs runs once per calibration batch (four
    here): the weights before the block are held for all of them, then put back, and it stops
    before the block's own weights are brought in. Each is read once more, by the forward that
    traces the stages; the block once more for its stage."""
    reference = llama_folder(tmp_path / "model")
    VERBS["gptq"](reference, batches(), exclude="lm_head").bake()
    source = surgery.offloaded(tmp_path / "model")
    read = []
    load = source.files.load
    source.files.load = lambda name: read.append(name) or load(name)
    done = VERBS["gptq"](source, batches(), exclude="lm_head")
    assert read.count("model.embed_tokens.weight") == 2  # was 1 + 4
    assert read.count("model.layers.0.mlp.up_proj.weight") == 2  # was 2 + 4
    assert all(p.is_meta for p in source.model.parameters()) and source.held is None
    assert torch.equal(logits(source.model), logits(reference))
    done.restore()


class EncoderThenBlocks(nn.Module):
    """Three layers outside the repeated blocks (an encoder), then three blocks."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.encoder = nn.Sequential(*(nn.Linear(32, 32) for _ in range(3)))
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.ReLU()) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.encoder(x)
        for block in self.blocks:
            x = block(x)
        return x


def test_the_weights_held_while_catching_inputs_stay_within_the_largest_group_outside_blocks(tmp_path):
    """Holding every layer before the first block would hold a whole encoder: what is held stays
    within the largest group outside the blocks (here one encoder layer), the rest is read per batch."""
    from safetensors.torch import save_file

    model = EncoderThenBlocks()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "m.safetensors")
    calibration = [torch.randn(4, 32, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    spec = GridSpec(bits=4, group_size=16)
    expected = surgery.quantize(
        model, weights=spec, method="gptq", calibration=calibration, select="blocks.**", progress=False
    )
    with torch.no_grad():
        want = model(calibration[0])
    expected.restore()
    source = surgery.offloaded(tmp_path / "m.safetensors", factory=EncoderThenBlocks)
    read = []
    load = source.files.load
    source.files.load = lambda name: read.append(name) or load(name)
    done = surgery.quantize(
        source, weights=spec, method="gptq", calibration=calibration, select="blocks.**", progress=False
    )
    # once to trace the stages, then: the first held for the four batches, the others read for each
    assert [read.count(f"encoder.{i}.weight") for i in range(3)] == [2, 5, 5]
    assert source.held is None and all(p.is_meta for p in source.model.parameters())
    with torch.no_grad():
        assert torch.equal(source.model(calibration[0]), want)
    done.restore()
