"""``format="sparse"``: pruned Linear layers as CSR (CPU) or 2:4 (GPU) sparse kernels, loaded
back with torch and compared with the model under surgery."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgery
from surgery.core.errors import ConfigError
from surgery.ops.export.formats.sparse_linear import SparseLinear, is_two_four, semi_structured


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10)).eval()


def dense_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_layers_pruned_past_the_threshold_run_as_csr_and_match_the_pruned_model(tmp_path):
    model = mlp()
    x = torch.randn(8, 128)
    with surgery.compose(surgery.prune(model, 0.95, select=["0", "2"]), surgery.prune(model, 0.5, select="4")) as group:
        expected = model(x)
        record = surgery.export(group, tmp_path / "m.pt", format="sparse", inputs=[x])
    assert record.parity.holds and record.parity.max_abs < 1e-5, record.parity
    loaded = record.load()
    assert [type(m).__name__ for m in loaded] == ["SparseLinear", "ReLU", "SparseLinear", "ReLU", "Linear"]
    assert loaded[0].weight.layout == torch.sparse_csr and loaded[0].weight.col_indices().dtype == torch.int32
    assert loaded[0].sparsity == pytest.approx(0.95, abs=1e-3)
    assert torch.allclose(loaded(x), expected, atol=1e-5)
    assert loaded(torch.randn(2, 3, 128)).shape == (2, 3, 10)  # leading dimensions kept
    assert record.bytes < 0.3 * dense_bytes(mlp())


def test_the_threshold_leaves_half_sparse_layers_dense_and_says_so(tmp_path):
    model = mlp()
    x = torch.randn(4, 128)
    with surgery.compose(surgery.prune(model, 0.95, select="0"), surgery.prune(model, 0.5, select="2")) as group:
        record = surgery.export(group, tmp_path / "m.pt", format="sparse", inputs=[x])
    assert record.left_out == ["2 (dense: below min_sparsity or not 2:4)"]
    assert isinstance(record.load()[2], nn.Linear) and not isinstance(record.load()[2], SparseLinear)


def test_two_four_layout_keeps_the_pattern_and_runs_dense_on_cpu(tmp_path):
    model = mlp()
    x = torch.randn(4, 128)
    with surgery.prune(model, 0.5, pattern="2:4", select=["0", "2"]) as handle:
        expected = model(x)
        record = surgery.export(handle, tmp_path / "m.pt", format="sparse", inputs=[x], layout="2:4")
    loaded = record.load()
    assert loaded[0].layout == "2:4" and is_two_four(loaded[0].weight) and is_two_four(loaded[2].weight)
    assert torch.equal(loaded(x), expected)  # on the CPU the weights stay dense: the same kernel


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's 2:4 kernels need a CUDA GPU")
def test_two_four_layers_run_on_semi_structured_kernels_on_a_gpu(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 128)).eval()
    x = torch.randn(64, 128)
    with surgery.prune(model, 0.5, pattern="2:4") as handle:
        expected = model(x)
        record = surgery.export(handle, tmp_path / "m.pt", format="sparse", layout="2:4")
    gpu = semi_structured(record.load())
    from torch.sparse import SparseSemiStructuredTensor

    assert isinstance(gpu[0].weight.data, SparseSemiStructuredTensor)
    found = gpu(x.cuda().half()).float().cpu()
    assert torch.nn.functional.cosine_similarity(found.flatten(), expected.flatten(), dim=0) > 0.999


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without a GPU")
def test_semi_structured_without_a_gpu_is_one_line():
    with pytest.raises(ConfigError, match=r"^export.options.layout='2:4': .*no GPU here$"):
        semi_structured(mlp())


def test_bad_sparse_exports_are_one_line_and_write_nothing(tmp_path):
    model = mlp()
    with surgery.prune(model, 0.5) as handle:
        with pytest.raises(ConfigError, match=r"no nn.Linear weight has at least 0.9 sparsity"):
            surgery.export(handle, tmp_path / "a.pt", format="sparse")
        with pytest.raises(ConfigError, match=r"^export.options.layout='coo': must be one of csr, 2:4$"):
            surgery.export(handle, tmp_path / "b.pt", format="sparse", layout="coo")
        with pytest.raises(ConfigError, match=r"^export.options.min_sparsity=2: must be a number in \[0, 1\]$"):
            surgery.export(handle, tmp_path / "c.pt", format="sparse", min_sparsity=2)
    with surgery.quantize(model) as handle:
        with pytest.raises(ConfigError, match=r"no pruning masks.*format='sparse' holds pruned Linear weights"):
            surgery.export(handle, tmp_path / "d.pt", format="sparse")
    calibration = [torch.randn(4, 128)]
    pruned = surgery.prune(model, 0.95)
    quantized = surgery.quantize(model, weights=None, activations=surgery.GridSpec(bits=8), calibration=calibration)
    with surgery.compose(pruned, quantized) as group:
        with pytest.raises(ConfigError, match=r"format='sparse' holds weights only"):
            surgery.export(group, tmp_path / "e.pt", format="sparse")
    assert list(tmp_path.iterdir()) == []
