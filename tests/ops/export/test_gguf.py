"""``format="gguf"``: surgery's own integers and scales in GGUF block types, read back by gguf-py
(every tensor dequantized equals the simulation's weight bit for bit) and loaded by transformers'
GGUF loader (outputs equal bit for bit); ``target="gguf:..."`` computes on the type's grid, and
what a type cannot hold is refused in one line, nothing written."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support import tiny_gpt2  # tests/support.py

import surgery
from surgery import GridSpec
from surgery.core.errors import ConfigError
from surgery.ops.export.formats.gguf.blocks import BLOCK_TYPES
from surgery.ops.export.formats.gguf.file import load_gguf, write_gguf
from surgery.ops.export.formats.gguf.models import permute_rows, tensor_name
from surgery.ops.numerics.deployment import ExportParts, WeightGrid
from surgery.ops.numerics.fake_quant import Grid

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")


def tiny(family: str, vocab: int = 128, width: int = 64, **settings: Any) -> torch.nn.Module:
    """A seeded tiny decoder of ``family`` (every row length a multiple of 32; of 256, the
    K-quants' super-block, with ``width=256``)."""
    torch.manual_seed(0)
    shapes = dict(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=4)
    shapes |= dict(num_key_value_heads=2, vocab_size=vocab, head_dim=width // 4, max_position_embeddings=2048)
    config = getattr(transformers, f"{family}Config")(**shapes | settings)
    return getattr(transformers, f"{family}ForCausalLM")(config).eval()


def ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


def read_back(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """Every tensor of the file: its GGUF type name and gguf-py's dequantized (rows, columns) values."""
    found = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        kind = gguf.GGMLQuantizationType(tensor.tensor_type).name
        found[tensor.name] = (kind, gguf.quants.dequantize(tensor.data, tensor.tensor_type))
    return found


@pytest.mark.parametrize("family", ["Llama", "Mistral", "Qwen2", "Qwen3"])
@pytest.mark.parametrize("kind", list(BLOCK_TYPES))
def test_every_tensor_reads_back_as_the_simulation_s_weight_and_transformers_computes_its_outputs(
    tmp_path, family, kind
):
    model = tiny(family, width=BLOCK_TYPES[kind].super_block if kind.endswith("_K") else 64)
    handle = surgery.quantize(model, weights=GridSpec(bits=4), target=f"gguf:{kind}", exclude="lm_head")
    record = surgery.export(handle, tmp_path / "m.gguf", format="gguf", inputs=[ids(1)])
    assert record.parity.expected == "exact" and record.parity.equal  # transformers' GGUF loader, bit for bit
    stored = read_back(record.path)
    for name, value in model.named_parameters():
        found_kind, data = stored[tensor_name(name)]
        expected = value.detach().float()
        permute = permute_rows(tensor_name(name), model.config)
        expected = expected if permute is None else permute(expected)
        assert found_kind == (kind if name in handle.weights else "F32"), name
        assert np.array_equal(data.reshape(expected.shape), expected.numpy()), name  # gguf-py's own decoder


@pytest.mark.parametrize("method", ["gptq", "autoround"])
def test_calibrated_methods_on_the_gguf_grid_export_exactly(tmp_path, method):
    model = tiny("Llama")
    spec = GridSpec(bits=4)
    calibration = [ids(seed) for seed in range(2)]
    handle = surgery.quantize(
        model,
        weights=spec,
        method={"name": method, **({"iterations": 3} if method == "autoround" else {})},
        target="gguf:Q4_0",
        exclude="lm_head",
        calibration=calibration,
    )
    for grid in handle.weights.values():  # the method rounded against the fp16 scale GGUF stores
        assert torch.equal(grid.scale.half().float(), grid.scale)
    record = surgery.export(handle, tmp_path / "m.gguf", format="gguf", inputs=[ids(1)])
    assert record.parity.equal


@pytest.mark.parametrize("kind", ["Q4_K", "Q3_K"])
def test_awq_then_gptq_on_a_k_quant_grid_exports_exactly(tmp_path, kind):
    model = tiny("Llama", width=256)
    calibration = [ids(seed) for seed in range(2)]
    spec = GridSpec(**BLOCK_TYPES[kind].target)
    scaled = surgery.awq(model, weights=spec, calibration=calibration, progress=False)  # its clip search too
    handle = surgery.quantize(
        model, weights=spec, method="gptq", target=f"gguf:{kind}", exclude="lm_head", calibration=calibration
    )
    record = surgery.export(surgery.compose(scaled, handle), tmp_path / "m.gguf", format="gguf", inputs=[ids(1)])
    assert record.parity.equal
    assert {kind} == {k for k, _ in read_back(record.path).values()} - {"F32"}


def test_the_q4_0_target_is_llama_cpp_s_own_q4_0_grid_but_for_ties():
    # llama.cpp's reference quantizer (gguf-py's transcription) rounds half up and picks the
    # first largest value's sign; surgery rounds half to even: measured 99.95 % equal values on
    # 256 x 1024 normal weights, every other value one step apart
    weight = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    spec = GridSpec(**BLOCK_TYPES["Q4_0"].target)
    grid = WeightGrid("w", spec, *Grid(spec, True).group_qparams(weight), 0, 0)
    ours = grid.dequantized(grid.row_integers(weight)).numpy()
    theirs = gguf.quants.dequantize(gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_0), 2)
    step = grid.scale.float().repeat_interleave(32, dim=1).numpy()
    assert (ours == theirs).mean() > 0.999
    assert np.all(np.abs(ours - theirs) <= step * 1.0001)


def test_a_byte_level_model_carries_its_byte_vocabulary(tmp_path):
    model = tiny("Llama", vocab=256)
    handle = surgery.quantize(model, weights=GridSpec(bits=8), target="gguf:Q8_0", exclude="lm_head")
    record = surgery.export(handle, tmp_path / "m.gguf", format="gguf")
    fields = gguf.GGUFReader(str(record.path)).fields
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in fields["tokenizer.ggml.tokens"].data]
    model_kind = bytes(fields["tokenizer.ggml.model"].parts[-1]).decode()
    assert model_kind == "gpt2" and len(tokens) == 256 == len(set(tokens))
    assert tokens[ord("a")] == "a" and tokens[ord(" ")] == "Ġ"  # GPT-2's byte-to-character map


@pytest.mark.parametrize(
    ("weights", "target", "options", "message"),
    [
        (
            GridSpec(bits=4, group_size=128),
            None,
            {},
            r"cannot hold model\.layers\.0\.self_attn\.q_proj\.weight exactly: "
            r"Q4_1 needs groups of 32 inputs .* Q4_0 needs .* quantize with target='gguf:<type>'",
        ),
        (GridSpec(bits=4, group_size=32, symmetric=True), None, {}, r"Q4_0 needs fp16 scales"),
        (GridSpec(bits=8, group_size=32, scale_dtype="float16"), None, {}, r"Q8_0 needs signed integers .*bits=8"),
        (GridSpec(bits=8), "gguf:Q8_0", {"type": "Q4_0"}, r"Q4_0 needs signed integers within \[-8, 7\] \(bits=8\)"),
        (GridSpec(bits=4), "gguf:Q4_0", {"type": "Q2_K"}, r"^export\.options\.type='Q2_K': must be one of Q8_0"),
        (GridSpec(bits=4), "gguf:Q4_0", {"tokenizer": object()}, r"^export\.options\.tokenizer='object'"),
    ],
)
def test_what_gguf_cannot_hold_is_refused_in_one_line_and_nothing_written(tmp_path, weights, target, options, message):
    model = tiny("Llama")  # held: a handle keeps only a weak reference to its model
    handle = surgery.quantize(model, weights=weights, target=target, exclude="lm_head")
    with pytest.raises(ConfigError, match=message):
        surgery.export(handle, tmp_path / "m.gguf", format="gguf", **options)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("width", "weights", "message"),
    [
        (
            64,
            GridSpec(bits=4),
            r"Q6_K needs groups of 16 inputs in rows of a multiple of 256 \(group_size=32, 64 inputs",
        ),
        (
            256,
            GridSpec(bits=6, observer="full_range", group_size=16, scale_dtype="float16"),
            r"Q6_K needs each group's scale an integer in \[1, 127\] times one fp16 scale per 256 inputs "
            r"\(quantize with target='gguf:Q6_K'\)",
        ),
    ],
)
def test_a_grid_without_the_k_quant_s_two_level_scales_is_refused(tmp_path, width, weights, message):
    model = tiny("Llama", width=width)
    target = "gguf:Q4_0" if weights.bits == 4 else None
    with (
        surgery.quantize(model, weights=weights, target=target, exclude="lm_head") as handle,
        pytest.raises(ConfigError, match=message) as raised,
    ):
        surgery.export(handle, tmp_path / "m.gguf", format="gguf", type="Q6_K")
    assert "\n" not in str(raised.value) and not list(tmp_path.iterdir())


def test_a_k_quant_target_refuses_a_model_whose_rows_are_not_whole_super_blocks():
    model = tiny("Llama")  # 64 inputs a row
    with pytest.raises(ConfigError, match=r"super_group=256: does not divide the 64 inputs of model\.layers\.0\."):
        surgery.quantize(model, weights=GridSpec(bits=4), target="gguf:Q3_K", exclude="lm_head")
    assert not any(module._forward_pre_hooks for module in model.modules())


def test_activation_quantization_and_other_models_are_refused(tmp_path):
    batch = ids()
    model = tiny("Llama")
    with pytest.raises(ConfigError, match=r"^quantize\.target='gguf:Q4_0': holds weight grids only"):  # when it starts
        surgery.quantize(
            model, weights=GridSpec(bits=4), activations=GridSpec(bits=8), target="gguf:Q4_0", calibration=[batch]
        )
    handle = surgery.quantize(model, weights=GridSpec(bits=4), activations=GridSpec(bits=8), calibration=[batch])
    with pytest.raises(ConfigError, match=r"holds weight grids only; .* activations are quantized"):
        surgery.export(handle, tmp_path / "m.gguf", format="gguf")
    handle.restore()
    other = tiny_gpt2()
    gpt2 = surgery.quantize(other, weights=GridSpec(bits=8))
    with pytest.raises(ConfigError, match=r"^export\.format='gguf': writes the decoder families llama, .* gpt2$"):
        surgery.export(gpt2, tmp_path / "g.gguf", format="gguf")
    assert not list(tmp_path.iterdir())


def test_unquantized_layers_stay_in_the_model_s_dtype_and_the_file_stays_exact(tmp_path):
    model = tiny("Qwen3").to(torch.bfloat16)
    handle = surgery.quantize(model, weights=GridSpec(bits=4), target="gguf:Q4_0", select="**.mlp.*")
    record = surgery.export(handle, tmp_path / "m.gguf", format="gguf")
    kinds = {name: kind for name, (kind, _) in read_back(record.path).items()}
    assert kinds["blk.0.ffn_up.weight"] == "Q4_0" and kinds["blk.0.attn_q.weight"] == "BF16"
    assert kinds["blk.0.attn_norm.weight"] == "F32" and kinds["token_embd.weight"] == "BF16"


def test_tiny_llama_rows_reach_the_llama_cpp_row_order(tmp_path):
    # the query rows llama.cpp reads are Hugging Face's, pair-interleaved per head (its converter's permute)
    model = tiny("Llama")
    handle = surgery.quantize(model, weights=GridSpec(bits=8), target="gguf:Q8_0", select="**.q_proj")
    record = surgery.export(handle, tmp_path / "m.gguf", format="gguf")
    _, stored = read_back(record.path)["blk.0.attn_q.weight"]
    weight = model.model.layers[0].self_attn.q_proj.weight.detach()
    head = 16
    first = torch.cat([weight[0:1], weight[head // 2 : head // 2 + 1]])  # rows 0 and 8 of head 0 become 0 and 1
    assert np.array_equal(stored[:2], first.numpy())


def test_a_plan_over_gguf_types_writes_a_mixed_file_of_the_bytes_it_counted(tmp_path):
    model = tiny("Llama")
    choices = ["dense", "gguf:Q8_0", "gguf:Q5_0", "gguf:Q4_0"]
    plan = surgery.plan(model, "5.5bpw", choices, calibration=[ids(seed) for seed in range(2)])
    assert len(plan.counts()) > 1  # a mix: 5.5 bits a weight sits between the types
    with plan.apply(model) as handle:
        record = surgery.export(handle, tmp_path / "m.gguf", format="gguf", inputs=[ids(1)])
    assert record.parity.equal
    stored = {t.name: t for t in gguf.GGUFReader(str(record.path)).tensors}
    for row in plan.rows:
        tensor = stored[tensor_name(f"{row.layer}.weight")]
        kind = gguf.GGMLQuantizationType(tensor.tensor_type).name
        assert kind == (row.choice.removeprefix("gguf:") if row.choice != "dense" else "F32"), row
        if row.choice != "dense":
            assert tensor.n_bytes == row.bytes  # the plan counted exactly what the file holds


def test_a_bfloat16_model_loads_back_in_bfloat16_with_the_simulation_s_outputs(tmp_path):
    # the file's float tensors say the dtype; each block's values rounded to bfloat16 as the
    # simulation rounds them (a model cast with .to(bfloat16) also casts its rotary buffers,
    # which transformers keeps in float32: load it with from_pretrained(dtype=...) instead)
    tiny("Llama").save_pretrained(tmp_path / "float")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "float", dtype=torch.bfloat16).eval()
    with surgery.quantize(model, weights=GridSpec(bits=4), target="gguf:Q4_0", exclude="lm_head") as handle:
        record = surgery.export(handle, tmp_path / "m.gguf", format="gguf", inputs=[ids(1)])
    assert record.parity.equal and record.load().dtype == torch.bfloat16


def test_a_grid_its_own_bits_cannot_hold_goes_to_the_smallest_type_that_holds_it(tmp_path, caplog):
    model = tiny("Llama")  # 4-bit affine: zero points anywhere in [0, 15], beyond Q4_0's [-8, 7]
    spec = GridSpec(bits=4, group_size=32, scale_dtype="float16")
    with surgery.quantize(model, weights=spec, select="**.mlp.*") as handle:
        record = surgery.export(handle, tmp_path / "m.gguf", format="gguf", inputs=[ids(1)])
    assert record.parity.equal and read_back(record.path)["blk.0.ffn_up.weight"][0] == "Q5_0"
    assert "model.layers.0.mlp.up_proj.weight is written as Q5_0" in caplog.text


def test_a_quantized_head_tied_to_the_embeddings_is_written_once_on_its_grid(tmp_path):
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        head_dim=16,
        tie_word_embeddings=True,
    )
    model = transformers.Qwen3ForCausalLM(config).eval()
    with surgery.quantize(model, weights=GridSpec(bits=4), target="gguf:Q4_0") as handle:  # the head too
        assert "lm_head.weight" in handle.weights
        record = surgery.export(handle, tmp_path / "m.gguf", format="gguf", inputs=[ids(1)])
    stored = read_back(record.path)
    assert stored["token_embd.weight"][0] == "Q4_0" and "output.weight" not in stored  # llama.cpp reuses it
    assert record.parity.equal


def test_a_mixture_of_experts_family_gguf_lacks_is_refused_naming_it(tmp_path):
    from support import tiny_moe

    model = tiny_moe("mixtral", layers=1)
    refused = r"^export\.format='gguf': writes the decoder families .* mixtral$"
    with pytest.raises(ConfigError, match=refused):  # by the target, when quantize starts
        surgery.quantize(model, weights=GridSpec(bits=4), target="gguf:Q4_0", exclude="**.gate")
    with surgery.quantize(model, weights=GridSpec(bits=4, group_size=32), exclude="**.gate") as handle:
        with pytest.raises(ConfigError, match=refused):
            surgery.export(handle, tmp_path / "m.gguf", format="gguf")
    assert not list(tmp_path.iterdir())


def test_qwen3_moe_experts_are_stacked_per_projection_and_read_back_as_each_expert_s_weight(tmp_path):
    from surgery.tasks.tinymoe import load_moe

    model = load_moe()  # the shipped Qwen3-MoE: 8 experts a layer, top-2 weights normalized as llama.cpp's
    write_gguf(ExportParts(model), tmp_path / "float.gguf", {})  # the fused experts: llama.cpp's gate and up stacks
    with torch.no_grad():
        assert torch.equal(load_gguf(tmp_path / "float.gguf")(ids(1)).logits, model(ids(1)).logits)
    with surgery.quantize(model, weights=GridSpec(bits=4), target="gguf:Q4_0", exclude="lm_head") as handle:
        record = surgery.export(handle, tmp_path / "m.gguf", format="gguf", inputs=[ids(1)])
        assert record.parity.equal
        stored = read_back(record.path)
        for projection in ("gate", "up", "down"):
            kind, data = stored[f"blk.1.ffn_{projection}_exps.weight"]
            keys = [f"model.layers.1.mlp.experts.{e}.{projection}_proj.weight" for e in range(8)]
            expected = torch.stack([model.get_parameter(key).detach() for key in keys])
            assert kind == "Q4_0" and np.array_equal(data.reshape(expected.shape), expected.numpy())
        assert stored["blk.1.ffn_gate_inp.weight"][0] == "F32"  # the router, as llama.cpp keeps it


@pytest.mark.parametrize(
    "family, config, message",
    [
        ("Mistral", {"sliding_window": 8}, r"config\.sliding_window is 8 with a context of 2048: .*no sliding window"),
        ("Llama", {"hidden_act": "gelu"}, r"config\.hidden_act is 'gelu'; llama\.cpp's graph computes SiLU"),
        (
            "Qwen2",
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
            r"config\.sliding_window is 8",
        ),
        ("Qwen3", {"attention_bias": True}, r"config\.attention_bias is true; .* no attention biases"),
        ("Llama", {"mlp_bias": True}, r"config\.mlp_bias is true; GGUF is written here without these biases"),
        ("Llama", {"made_up_knob": 3}, r"config\.made_up_knob=3 is not a field it understands"),
        (
            "Llama",
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            r"config\.rope_parameters sets partial_rotary_factor",
        ),
    ],
    ids=["mistral-window", "llama-gelu", "qwen2-window", "qwen3-bias", "llama-bias", "unknown-field", "partial-rope"],
)
def test_a_config_field_llama_cpp_cannot_compute_is_refused_by_name_before_anything_is_written(
    tmp_path, family, config, message
):
    """Hostile pass, wave 4, item 2: a Mistral with an 8-token window was written as full attention
    (cosine 0.88 at 48 tokens, parity 1.0 on 8), a GELU Llama as SiLU. Every config field is one the
    family's table understands: written, required to hold llama.cpp's value, or refused."""
    model = tiny(family, **config)
    with pytest.raises(ConfigError, match=r"^export\.format='gguf': .*" + message):
        write_gguf(ExportParts(model), tmp_path / "m.gguf", {})
    with pytest.raises(ConfigError, match=message):
        surgery.quantize(model, weights=GridSpec(bits=8), target="gguf:Q8_0", exclude="lm_head")  # when it starts
    with pytest.raises(ConfigError, match=message):
        surgery.gguf_mix(model, "Q4_K_M")
    assert not list(tmp_path.iterdir())


def test_swish_is_silu_and_a_dense_layer_among_experts_is_named_by_its_own_field(tmp_path):
    from support import tiny_moe

    model = tiny("Llama", hidden_act="swish")  # transformers' other name for SiLU
    surgery.gguf_mix(tiny("Llama", width=256, hidden_act="swish"), "Q4_K_M")
    write_gguf(ExportParts(model), tmp_path / "m.gguf", {})
    assert (tmp_path / "m.gguf").stat().st_size > 0
    moe = tiny_moe("qwen3_moe", layers=2)
    moe.config.norm_topk_prob, moe.config.mlp_only_layers = True, [0]
    with pytest.raises(ConfigError, match=r"config\.mlp_only_layers leaves some layers dense"):
        write_gguf(ExportParts(moe), tmp_path / "moe.gguf", {})


def test_a_window_that_never_acts_is_written(tmp_path):
    model = tiny("Mistral")
    model.config.sliding_window = 2048  # the whole context: full attention
    with surgery.quantize(model, weights=GridSpec(bits=8), target="gguf:Q8_0", exclude="lm_head") as handle:
        record = surgery.export(handle, tmp_path / "m.gguf", format="gguf", inputs=[ids()])
    assert record.parity.holds


def test_experts_partly_quantized_or_a_routing_llama_cpp_lacks_are_refused(tmp_path):
    from support import tiny_moe

    from surgery.tasks.tinymoe import load_moe

    model = load_moe()
    exclude = ["lm_head", "model.layers.0.mlp.experts.1.*"]
    with surgery.quantize(model, weights=GridSpec(bits=4), target="gguf:Q4_0", exclude=exclude) as handle:
        with pytest.raises(ConfigError, match=r"blk\.0\.ffn_gate_exps\.weight stacks experts some quantized, some not"):
            surgery.export(handle, tmp_path / "m.gguf", format="gguf")
    unnormalized = tiny_moe("qwen3_moe", layers=1)  # transformers' default: top-k weights not normalized
    with pytest.raises(
        ConfigError, match=r"config.norm_topk_prob is false; llama.cpp.s graph normalizes the top-k expert weights"
    ):
        write_gguf(ExportParts(unnormalized), tmp_path / "m.gguf", {})
    assert not list(tmp_path.iterdir())


def test_a_q4_k_m_mix_puts_llama_cpp_s_layers_on_q6_k_and_writes_one_exact_file(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=12, num_attention_heads=4, num_key_value_heads=2
    )
    config.vocab_size = 128
    model = transformers.LlamaForCausalLM(config).eval()
    plan = surgery.gguf_mix(model, "Q4_K_M", method="gptq")
    more = {0, 3, 6, 9, 10, 11}  # llama.cpp's use_more_bits at 12 layers: the first and last eighth, every third
    for row in plan.rows:
        layer = int(row.layer.split(".")[2])
        bumped = row.layer.endswith(("v_proj", "down_proj")) and layer in more
        assert row.choice == ("gguf:Q6_K" if bumped else "gguf:Q4_K"), row.layer
    assert len(plan.rows) == 7 * 12 and plan.method == "gptq"
    with plan.apply(model, calibration=[ids(seed) for seed in range(2)]) as handle:
        record = surgery.export(handle, tmp_path / "m.gguf", format="gguf", inputs=[ids(1)])
        assert record.parity.equal
        surgery.export(handle, tmp_path / "typed.gguf", format="gguf", type="Q4_K_M")  # each tensor its mix type
    with surgery.quantize(model, weights=GridSpec(bits=4), target="gguf:Q4_K", exclude="lm_head") as uniform:
        with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn\.v_proj\.weight exactly: Q6_K needs"):
            surgery.export(uniform, tmp_path / "uniform.gguf", format="gguf", type="Q4_K_M")
    assert (tmp_path / "m.gguf").read_bytes() == (tmp_path / "typed.gguf").read_bytes()
    kinds = {name: kind for name, (kind, _) in read_back(record.path).items()}
    assert kinds["blk.3.attn_v.weight"] == kinds["blk.11.ffn_down.weight"] == "Q6_K"
    assert kinds["blk.1.attn_v.weight"] == kinds["blk.3.attn_q.weight"] == "Q4_K"


def test_a_mix_whose_blocks_do_not_tile_a_layer_is_refused_in_one_line():
    with pytest.raises(
        ConfigError, match=r"^plan\.mix='Q4_K_M': puts model\.layers\.0\.self_attn\.q_proj\.weight on gguf:Q4_K"
    ):
        surgery.gguf_mix(tiny("Llama"), "Q4_K_M")
    with pytest.raises(
        ConfigError, match=r"^plan\.mix='Q4_K_S': must be one of Q4_K_M, Q5_K_M \(one name, a string\)$"
    ):
        surgery.gguf_mix(tiny("Llama"), "Q4_K_S")


@pytest.mark.parametrize("kind", ["Q4_0", "Q3_K", "Q6_K"])
def test_all_zero_groups_stay_on_the_target_s_type(tmp_path, kind):
    # an all-zero group's range is [0, 0]: its full-range zero point must still be the grid's own
    # (it once came out 0, which neither orientation of Q4_0/Q3_K/Q6_K holds)
    model = tiny("Llama", width=256 if kind.endswith("_K") else 64)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[:8] = 0  # whole rows pruned
        model.model.layers[0].mlp.down_proj.weight[:, :32] = 0  # a whole group of inputs
    with surgery.quantize(
        model, weights=GridSpec(bits=4), method="gptq", target=f"gguf:{kind}", exclude="lm_head", calibration=[ids(0)]
    ) as handle:
        record = surgery.export(handle, tmp_path / "m.gguf", format="gguf", inputs=[ids(1)])
        assert record.parity.equal
    assert {k for k, _ in read_back(record.path).values()} == {kind, "F32"}


def test_a_weight_beyond_float16_is_refused_naming_the_stored_dtype_and_the_model_is_left_as_it_was():
    model = tiny("Llama", width=256)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[0, 0] = -70000.0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ConfigError, match=r"^quantize\.weights\.scale_dtype='float16': cannot hold a group's offset 70000"
    ):
        surgery.quantize(model, weights=GridSpec(bits=4), method="gptq", target="gguf:Q4_K", calibration=[ids(0)])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_a_mix_that_would_leave_fused_experts_float_is_refused():
    from surgery.tasks.tinymoe import load_moe

    with pytest.raises(
        ConfigError, match=r"^plan\.mix='Q4_K_M': plans Linear layers; model\.layers\.0\.mlp\.experts\."
    ):
        surgery.gguf_mix(load_moe(), "Q4_K_M")


def test_a_mix_for_a_model_gguf_cannot_write_is_refused():
    with pytest.raises(ConfigError, match=r"writes the decoder families .* this model is gpt2$"):
        surgery.gguf_mix(tiny_gpt2(), "Q4_K_M")


TEXTS = ["Hello world, it's 3.14 here.", "  two  spaces\tand tabs\n", "caf\u00e9 na\u00efve <|endoftext|> end"]


def test_a_byte_level_bpe_tokenizer_travels_with_its_tokens_merges_and_special_ids(tmp_path):
    from support import byte_bpe_tokenizer

    tokenizer = byte_bpe_tokenizer()
    model = tiny("Llama", vocab=len(tokenizer) + 4)  # four embedding rows no token uses
    with surgery.quantize(model, weights=GridSpec(bits=4), target="gguf:Q4_0", exclude="lm_head") as handle:
        record = surgery.export(handle, tmp_path / "m.gguf", format="gguf", tokenizer=tokenizer, inputs=[ids(1)])
        assert record.parity.equal
    fields = gguf.GGUFReader(str(record.path)).fields
    strings = lambda key: [bytes(fields[key].parts[i]).decode() for i in fields[key].data]  # noqa: E731
    scalar = lambda key: fields[key].parts[-1][0]  # noqa: E731
    vocab = tokenizer.get_vocab()
    tokens = strings("tokenizer.ggml.tokens")
    assert len(tokens) == len(tokenizer) + 4 and all(tokens[index] == token for token, index in vocab.items())
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    assert strings("tokenizer.ggml.merges") == [" ".join(pair) for pair in merges]
    assert bytes(fields["tokenizer.ggml.pre"].parts[-1]).decode() == "gpt-2"
    assert scalar("tokenizer.ggml.eos_token_id") == tokenizer.eos_token_id
    kinds = [fields["tokenizer.ggml.token_type"].parts[i][0] for i in fields["tokenizer.ggml.token_type"].data]
    assert kinds[tokenizer.eos_token_id] == gguf.TokenType.CONTROL and kinds[-1] == gguf.TokenType.UNUSED
    tokenizer.save_pretrained(tmp_path / "tokenizer")  # its folder, as export.options.tokenizer names it
    with surgery.quantize(model, weights=GridSpec(bits=4), target="gguf:Q4_0", exclude="lm_head") as handle:
        again = surgery.export(handle, tmp_path / "again.gguf", format="gguf", tokenizer=str(tmp_path / "tokenizer"))
    assert again.path.read_bytes() == record.path.read_bytes()


@pytest.mark.parametrize(("split", "add_bos"), [("llama-bpe", True), ("qwen2", False)])
def test_llama_3_and_qwen2_splits_are_named_by_llama_cpp_s_pre_tokenizers(tmp_path, split, add_bos, caplog):
    from support import byte_bpe_tokenizer

    tokenizer = byte_bpe_tokenizer(split=split)
    model = tiny("Llama", vocab=len(tokenizer))
    write_gguf(ExportParts(model), tmp_path / "m.gguf", {"tokenizer": tokenizer})
    fields = gguf.GGUFReader(str(tmp_path / "m.gguf")).fields
    assert bytes(fields["tokenizer.ggml.pre"].parts[-1]).decode() == split
    # Llama 3's template puts its bos first: llama.cpp is told so; Qwen2's adds none
    assert (
        bool(fields["tokenizer.ggml.add_bos_token"].parts[-1][0]),
        bool(fields["tokenizer.ggml.add_eos_token"].parts[-1][0]),
    ) == (add_bos, False)
    normalized = "does not apply the tokenizer's NFC normalization" in caplog.text
    assert normalized == (split == "qwen2")  # llama.cpp's qwen2 tokenizer skips NFC, as its converter lets through


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda spec: spec["model"].update(ignore_merges=False),
            r"keeps merges for words in its vocabulary \(ignore_merges=False\), which llama\.cpp's llama-bpe",
        ),
        (
            lambda spec: spec.update(normalizer={"type": "NFKC"}),
            r"normalizes text first \(\{\"type\": \"NFKC\"\}\), which llama\.cpp's llama-bpe tokenizer does not",
        ),
        (
            lambda spec: spec["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\s+"),
            r"splits text with Sequence \{\"pretokenizers\"",
        ),
        (
            lambda spec: spec["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
            r"splits text with Sequence",
        ),
    ],
)
def test_a_split_that_only_looks_like_llama_3_s_is_refused_in_one_line(tmp_path, change, message):
    from support import byte_bpe_tokenizer
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(byte_bpe_tokenizer(split="llama-bpe").backend_tokenizer.to_str())
    change(spec)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)))
    with pytest.raises(
        ConfigError,
        match=rf"^export\.options\.tokenizer='tokenizer': {message}.*\(llama\.cpp would split text into other tokens\)$",
    ):
        write_gguf(ExportParts(tiny("Llama", vocab=len(tokenizer))), tmp_path / "m.gguf", {"tokenizer": tokenizer})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("legacy", [False, True])
def test_a_sentencepiece_tokenizer_is_written_as_llama_cpp_s_llama_model_with_scores_by_merge(tmp_path, legacy, caplog):
    from support import sentencepiece_tokenizer

    tokenizer = sentencepiece_tokenizer(legacy=legacy)
    write_gguf(ExportParts(tiny("Llama", vocab=len(tokenizer))), tmp_path / "m.gguf", {"tokenizer": tokenizer})
    fields = gguf.GGUFReader(str(tmp_path / "m.gguf")).fields
    values = lambda key: [fields[key].parts[i][0] for i in fields[key].data]  # noqa: E731
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in fields["tokenizer.ggml.tokens"].data]
    assert bytes(fields["tokenizer.ggml.model"].parts[-1]).decode() == "llama"
    assert "tokenizer.ggml.merges" not in fields and bool(fields["tokenizer.ggml.add_space_prefix"].parts[-1][0])
    kinds, scores, vocab = values("tokenizer.ggml.token_type"), values("tokenizer.ggml.scores"), tokenizer.get_vocab()
    assert kinds[vocab["<unk>"]] == gguf.TokenType.UNKNOWN and kinds[vocab["<s>"]] == gguf.TokenType.CONTROL
    assert kinds[vocab["<0x0A>"]] == gguf.TokenType.BYTE and kinds[vocab["\u2581t"]] == gguf.TokenType.NORMAL
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    first = "".join(merges[0]) if isinstance(merges[0], list) else merges[0].replace(" ", "")
    assert scores[tokens.index(first)] == 0.0 and scores[tokens.index("".join(merges[-1]))] == -(len(merges) - 1)
    assert ("puts no \u2581 before a text that starts with a space" in caplog.text) == (not legacy)


def test_a_byte_fallback_bpe_not_converted_from_sentencepiece_is_refused_in_one_line(tmp_path):
    from support import sentencepiece_tokenizer
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(sentencepiece_tokenizer().backend_tokenizer.to_str())

    def refused(change: object, message: str) -> None:
        changed = json.loads(json.dumps(spec))
        change(changed)
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(changed)))
        with pytest.raises(ConfigError, match=rf"^export\.options\.tokenizer='tokenizer': {message}.*other tokens\)$"):
            write_gguf(ExportParts(tiny("Llama", vocab=len(tokenizer))), tmp_path / "m.gguf", {"tokenizer": tokenizer})

    # a merge left out: llama.cpp would still merge the two pieces, the Hugging Face BPE would not;
    # one of "▁the"'s two merges moved last: llama.cpp scores a token once, the BPE ranks each merge
    refused(lambda s: s["model"]["merges"].pop(5), r"has no merge '.+' \+ '.+' though both and '.+' are tokens")
    refused(
        lambda s: s["model"]["merges"].append(s["model"]["merges"].pop(6)), r"merges '.+' \+ '.+' into '.+' apart from"
    )
    refused(lambda s: s["model"]["vocab"].pop("<0x41>"), r"falls back to bytes without the byte tokens <0x41>")
    refused(lambda s: s["pre_tokenizer"].update(split=True), r"normalizes or splits text as llama\.cpp's SentencePiece")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("kind", "added", "message"),
    [
        ("gpt-2", {"content": "<R>", "rstrip": True}, r"adds '<R>' with rstrip, which llama\.cpp's tokenizer does not"),
        ("gpt-2", {"content": "<mask>", "lstrip": True, "special": True}, r"adds '<mask>' with lstrip"),
        ("gpt-2", {"content": "<W>", "single_word": True}, r"adds '<W>' with single_word"),
        ("sentencepiece", {"content": "<tool>"}, r"adds '<tool>' as a token that is not special, which llama\.cpp's"),
    ],
)
def test_added_tokens_llama_cpp_would_match_otherwise_are_refused_in_one_line(tmp_path, kind, added, message):
    # found by a hostile review: llama.cpp matched them where transformers did not (or put a ▁ after)
    import copy

    from support import byte_bpe_tokenizer, sentencepiece_tokenizer
    from tokenizers import AddedToken

    tokenizer = copy.deepcopy(sentencepiece_tokenizer() if kind == "sentencepiece" else byte_bpe_tokenizer(600))
    content = added.pop("content")
    special = added.pop("special", False)
    tokenizer.add_tokens([AddedToken(content, special=special, **added)], special_tokens=special)
    with pytest.raises(ConfigError, match=rf"^export\.options\.tokenizer='tokenizer': {message}.*other tokens\)$"):
        write_gguf(ExportParts(tiny("Llama", vocab=len(tokenizer))), tmp_path / "m.gguf", {"tokenizer": tokenizer})
    assert not list(tmp_path.iterdir())


def test_a_tokenizer_llama_cpp_would_split_otherwise_is_refused_in_one_line(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    model = tiny("Llama")  # held: a handle keeps only a weak reference to its model
    with surgery.quantize(model, weights=GridSpec(bits=4), target="gguf:Q4_0", exclude="lm_head") as handle:
        with pytest.raises(ConfigError, match=r"^export\.options\.tokenizer='tokenizer': splits text with Whitespace"):
            surgery.export(handle, tmp_path / "m.gguf", format="gguf", tokenizer=tokenizer)
        with pytest.raises(ConfigError, match=r"must be a folder holding a Hugging Face tokenizer\.json$"):
            surgery.export(handle, tmp_path / "m.gguf", format="gguf", tokenizer=str(tmp_path))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "settings, gptq, message",
    [
        ({"intermediate_size": 48}, {}, r"^quantize\.target='gguf:Q4_0': cannot hold model\.layers\.0\.mlp\.down_proj"),
        ({}, {"actorder": "group"}, r"^quantize\.method\.actorder='group': target='gguf:Q4_0' holds groups of"),
    ],
    ids=["48-inputs", "actorder-group"],
)
def test_a_gguf_target_refuses_what_its_type_cannot_hold_before_any_calibration(settings, gptq, message):
    """Hostile pass, wave 4, item 8: GPTQ calibrated the whole model before export refused."""
    model = tiny("Llama", **settings)
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    spec, method = GridSpec(bits=4), {"name": "gptq", **gptq}
    try:
        with pytest.raises(ConfigError, match=message):
            surgery.quantize(
                model, weights=spec, method=method, target="gguf:Q4_0", exclude="lm_head", calibration=[ids()]
            )
    finally:
        hook.remove()
    assert forwards == []  # refused before the first forward


def _broken_tokenizer_folder(folder: Path, how: str) -> Path:
    """A saved byte-level BPE tokenizer, then broken as ``how`` says; the file it breaks."""
    from support import byte_bpe_tokenizer

    byte_bpe_tokenizer().save_pretrained(folder)
    main, config = folder / "tokenizer.json", folder / "tokenizer_config.json"
    spec = json.loads(main.read_text())
    if how == "truncated":
        main.write_text(main.read_text()[:500])
    elif how == "not-utf8":
        main.write_bytes(b"\xff\xfe" + main.read_bytes())
    elif how == "config-not-json":
        config.write_text("{nope")
        return config
    elif how == "bad-added":
        spec["added_tokens"][0]["id"] = "x"
        main.write_text(json.dumps(spec))
    elif how == "no-model":
        del spec["model"]
        main.write_text(json.dumps(spec))
    else:  # auto_map, whatever its value
        config.write_text(json.dumps(json.loads(config.read_text()) | {"auto_map": None}))
        return folder
    return main


@pytest.mark.parametrize(
    "how, message",
    [
        ("truncated", r"is not JSON \(JSONDecodeError"),
        ("not-utf8", r"is not UTF-8 text \(byte 0"),
        ("config-not-json", r"is not JSON"),
        ("bad-added", r"has a malformed added token"),
        ("no-model", r"has no 'model' object"),
        ("auto-map", r"asks to run its own code \('auto_map' in tokenizer_config\.json\)"),
    ],
)
@pytest.mark.parametrize("format", ["gguf", "compressed-tensors"])
def test_a_broken_tokenizer_folder_is_named_with_its_file_in_both_formats(tmp_path, how, message, format):
    """Hostile pass, wave 4, item 4: a broken tokenizer was blamed on the format and the model
    (``cannot write LlamaForCausalLM (JSONDecodeError ...)``); GGUF and compressed-tensors disagreed on
    an ``auto_map`` of null."""
    broken = _broken_tokenizer_folder(tmp_path / "tokenizer", how)
    model = tiny("Llama", vocab=320)
    weights = GridSpec(bits=4) if format == "gguf" else GridSpec(bits=4, group_size=32)
    target, out = ("gguf:Q4_0", "m.gguf") if format == "gguf" else (None, "folder")
    with surgery.quantize(model, weights=weights, target=target, exclude="lm_head") as handle:
        with pytest.raises(ConfigError, match=rf"^export\.options\.tokenizer='{re.escape(str(broken))}': {message}"):
            surgery.export(handle, tmp_path / out, format=format, tokenizer=tmp_path / "tokenizer")
    assert not (tmp_path / out).exists()


@pytest.mark.parametrize("given", [["Q4_0"], {"Q4_0": 1}, 4])
def test_a_type_that_is_not_one_name_is_refused_naming_the_argument(tmp_path, given):
    """Hostile pass, wave 4, item 9: a list was a TypeError traceback (gguf_mix) or 'cannot write
    LlamaForCausalLM (TypeError: unhashable ...)' (export)."""
    model = tiny("Llama")
    with pytest.raises(ConfigError, match=r"^plan\.mix=.*: must be one of Q4_K_M, Q5_K_M \(one name, a string\)$"):
        surgery.gguf_mix(model, given)
    with surgery.quantize(model, weights=GridSpec(bits=4), target="gguf:Q4_0", exclude="lm_head") as handle:
        with pytest.raises(ConfigError, match=r"^export\.options\.type=.*: must be one of Q8_0, .*Q4_K_M, Q5_K_M"):
            surgery.export(handle, tmp_path / "m.gguf", format="gguf", type=given)
    assert not list(tmp_path.iterdir())


def test_a_token_past_the_embeddings_or_an_id_given_twice_is_named(tmp_path):
    from support import byte_bpe_tokenizer

    tokenizer = byte_bpe_tokenizer()  # 320 tokens
    with pytest.raises(ConfigError, match=r"has the token .* at id 300; the model embeds 300 tokens \(ids 0 to 299\)$"):
        write_gguf(ExportParts(tiny("Llama", vocab=300)), tmp_path / "m.gguf", {"tokenizer": tokenizer})
    tokenizer.save_pretrained(tmp_path / "tokenizer")
    main = tmp_path / "tokenizer" / "tokenizer.json"
    spec = json.loads(main.read_text())
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]
    vocab[second] = vocab[first]  # one id, two tokens: one would be lost
    main.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match=rf"gives id {vocab[first]} to both"):
        write_gguf(ExportParts(tiny("Llama", vocab=320)), tmp_path / "m.gguf", {"tokenizer": tmp_path / "tokenizer"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer"]


def test_named_chat_templates_are_all_written_the_default_as_llama_cpp_s(tmp_path):
    from support import byte_bpe_tokenizer

    tokenizer = byte_bpe_tokenizer()
    tokenizer.chat_template = {"default": "{{ messages[0]['content'] }}", "tool_use": "{{ tools }}"}
    write_gguf(ExportParts(tiny("Llama", vocab=320)), tmp_path / "m.gguf", {"tokenizer": tokenizer})
    fields = gguf.GGUFReader(str(tmp_path / "m.gguf")).fields
    text = lambda key: bytes(fields[key].parts[-1]).decode()  # noqa: E731
    assert text("tokenizer.chat_template") == "{{ messages[0]['content'] }}"
    assert text("tokenizer.chat_template.tool_use") == "{{ tools }}"


def test_a_sentencepiece_tokenizer_naming_no_unk_token_keeps_its_byte_tokens_byte(tmp_path):
    """Found in the wave-4 hostile pass: without an unk token the 256 ``<0xXX>`` pieces were written
    as normal tokens (llama.cpp would print them as text, not bytes)."""
    from collections import Counter

    from support import sentencepiece_tokenizer

    from surgery.ops.export.formats.gguf.tokenizer import vocabulary

    folder = tmp_path / "tokenizer"
    sentencepiece_tokenizer().save_pretrained(folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["unk_token"] = None
    config.pop("added_tokens_decoder", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    special = folder / "special_tokens_map.json"
    if special.exists():
        special.write_text(json.dumps({k: v for k, v in json.loads(special.read_text()).items() if k != "unk_token"}))
    found = vocabulary(folder, tiny("Llama", vocab=600).config, gguf.vocab.bytes_to_unicode)
    assert Counter(found.kinds)["byte"] == 256


def test_a_fifo_or_a_folder_in_place_of_a_tokenizer_file_is_refused_not_waited_on(tmp_path):
    """Found by the wave-4 hostile pass: a FIFO as tokenizer_config.json blocked the export for ever."""
    import os

    from support import byte_bpe_tokenizer

    folder = tmp_path / "tokenizer"
    byte_bpe_tokenizer().save_pretrained(folder)
    (folder / "tokenizer_config.json").unlink()
    os.mkfifo(folder / "tokenizer_config.json")
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json': is not a regular file$"):
        write_gguf(ExportParts(tiny("Llama", vocab=320)), tmp_path / "m.gguf", {"tokenizer": folder})


def test_a_chat_template_that_is_not_text_is_said_not_dropped_silently(tmp_path, caplog):
    from support import byte_bpe_tokenizer

    tokenizer = byte_bpe_tokenizer()
    tokenizer.chat_template = 5
    with caplog.at_level(logging.WARNING, logger="surgery"):
        write_gguf(ExportParts(tiny("Llama", vocab=320)), tmp_path / "m.gguf", {"tokenizer": tokenizer})
    assert "chat template is a int, not text; the GGUF carries none" in caplog.text


def test_the_one_table_of_block_types_holds_gguf_py_s_sizes():
    gguf = pytest.importorskip("gguf")
    from surgery.ops.export.formats.gguf.blocks import FLOAT_BYTES, tensor_bytes

    for name, kind in BLOCK_TYPES.items():
        block, size = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, name)]
        assert (kind.super_block, kind.block_bytes) == (block, size), name
        assert tensor_bytes(kind, (3, 2 * block)) == (3 * 2 * size, (3, 2 * size))
    for name, width in FLOAT_BYTES.items():
        block, size = gguf.GGML_QUANT_SIZES[getattr(gguf.GGMLQuantizationType, name)]
        assert (block, size) == (1, width), name
        assert tensor_bytes(name, (3, 5)) == (15 * width, (3, 5 * width))
