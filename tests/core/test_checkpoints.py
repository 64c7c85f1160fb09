"""surgery.core.checkpoints: safe loading with clear errors, saving that never overwrites (failed and
interrupted writes: tests/core/test_atomic_writes.py)."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import surgery
from surgery.core.checkpoints import load_checkpoint, read_state_dict, save_checkpoint, write_atomically
from surgery.testing import collect, snapshot, snapshot_differences

SUFFIXES = [".safetensors", ".pt"]


class Payload:
    """A class instance: loading it needs code, which ``weights_only=True`` must refuse."""

    def __init__(self) -> None:
        self.value = 1


@pytest.fixture(params=SUFFIXES)
def suffix(request) -> str:
    return request.param


def assert_load_refused(model: nn.Module, path: Path, match: str) -> None:
    before = snapshot(model)
    with pytest.raises(surgery.CheckpointError, match=match) as info:
        load_checkpoint(model, path)
    assert isinstance(info.value, ValueError)
    assert str(path) in str(info.value)  # the message says which file
    assert snapshot_differences(before, snapshot(model)) == []


@pytest.mark.parametrize("pruned", [False, True])
def test_save_then_load_into_a_fresh_instance_reproduces_outputs(
    convnet, convnet_factory, image_input, tmp_path, suffix, pruned
):
    handle = surgery.prune(convnet, 0.5) if pruned else None
    expected = collect(convnet, [image_input])
    path = save_checkpoint(convnet, tmp_path / f"model{suffix}")
    if handle is not None:
        handle.restore()
    fresh = load_checkpoint(convnet_factory(seed=9), path)
    assert torch.equal(collect(fresh, [image_input])[0], expected[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"model{suffix}"]  # no temporary left


def test_tied_weights_save_under_every_key_and_load_strictly(tmp_path, suffix):
    def tied(seed):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        model[1].weight = model[0].weight
        return model

    path = save_checkpoint(tied(0), tmp_path / f"tied{suffix}")
    assert set(read_state_dict(path)) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    fresh = load_checkpoint(tied(1), path)
    assert torch.equal(fresh[0].weight, tied(0)[0].weight)
    assert fresh[1].weight is fresh[0].weight


def test_missing_file(mlp, tmp_path):
    assert_load_refused(mlp, tmp_path / "absent.pt", "no such file")


def test_directory_is_not_a_checkpoint(mlp, tmp_path):
    assert_load_refused(mlp, tmp_path, "is a folder, not a checkpoint file")


def test_a_device_or_a_pipe_is_named_as_such_not_as_missing(mlp, tmp_path):
    """Before: /dev/zero, a FIFO or a folder were all "no such file"."""
    import os

    os.mkfifo(tmp_path / "pipe.pt")
    for path in ("/dev/zero", tmp_path / "pipe.pt"):
        assert_load_refused(mlp, path, "is not a regular file \\(a device or a pipe\\)")


def test_random_bytes_and_a_renamed_safetensors_file_are_not_said_to_carry_code(mlp, tmp_path):
    """Before: both were "refused by weights_only=True, the file carries more than tensors"."""
    noise = tmp_path / "noise.pt"
    noise.write_bytes(bytes(range(256)) * 40)
    assert_load_refused(mlp, noise, "corrupted or truncated checkpoint, or not a torch.save or safetensors file")
    renamed = tmp_path / "renamed.pt"
    renamed.write_bytes(save_checkpoint(mlp, tmp_path / "real.safetensors").read_bytes())
    assert_load_refused(mlp, renamed, "is a safetensors file; name it with the .safetensors suffix")


def test_a_float8_checkpoint_loads_into_a_float32_model(mlp, tmp_path):
    """Before: NotImplementedError ("isfinite" not implemented for Float8_e4m3fn) escaped."""
    state = {k: v.to(torch.float8_e4m3fn) for k, v in mlp.state_dict().items()}
    path = tmp_path / "f8.safetensors"
    save_file(state, str(path))
    fresh = load_checkpoint(mlp, path)
    assert torch.equal(fresh[0].weight, state["0.weight"].float())


def test_quantized_or_sparse_tensors_are_refused_without_torch_warnings(mlp, tmp_path, recwarn):
    state = mlp.state_dict()
    state["0.weight"] = state["0.weight"].to_sparse()
    torch.save(state, tmp_path / "sparse.pt")
    assert_load_refused(mlp, tmp_path / "sparse.pt", "layout torch.sparse_coo")
    assert [str(w.message) for w in recwarn] == []


@pytest.mark.parametrize("keep", [0, 1, 8, 64, 0.5, -40, -1])
def test_truncated_file(mlp, tmp_path, suffix, keep):
    path = save_checkpoint(mlp, tmp_path / f"whole{suffix}")
    data = path.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep if keep >= 0 else len(data) + keep
    broken = tmp_path / f"broken{suffix}"
    broken.write_bytes(data[:cut])
    assert_load_refused(mlp, broken, "corrupted or truncated|refused by weights_only")


def test_random_bytes(mlp, tmp_path, suffix):
    path = tmp_path / f"noise{suffix}"
    path.write_bytes(
        torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)).numpy().tobytes()
    )
    assert_load_refused(mlp, path, "corrupted or truncated|refused by weights_only")


def test_wrong_architecture(mlp, convnet, tmp_path, suffix):
    path = save_checkpoint(convnet, tmp_path / f"convnet{suffix}")
    assert_load_refused(mlp, path, "does not fit")


def test_wrong_shapes_are_named(mlp, tmp_path):
    wider = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    path = save_checkpoint(wider, tmp_path / "wider.pt")
    assert_load_refused(mlp, path, "shape mismatch")


def test_missing_and_unexpected_keys_are_counted(mlp, tmp_path):
    state = mlp.state_dict()
    state["extra"] = torch.zeros(1)
    del state["0.bias"]
    torch.save(state, tmp_path / "keys.pt")
    assert_load_refused(mlp, tmp_path / "keys.pt", "1 missing key")
    assert_load_refused(mlp, tmp_path / "keys.pt", "1 unexpected key")


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(lambda state: Payload(), id="object"),
        pytest.param(lambda state: {"state_dict": state, "extra": Payload()}, id="object-beside-weights"),
        pytest.param(lambda state: {**state, "0.weight": Payload()}, id="object-among-weights"),
    ],
)
def test_pickle_carrying_code_is_refused(mlp, tmp_path, payload):
    path = tmp_path / "code.pt"
    torch.save(payload(mlp.state_dict()), path)
    assert_load_refused(mlp, path, "weights_only")


def test_plain_values_that_are_not_a_state_dict_are_refused(mlp, tmp_path):
    torch.save([1, 2, 3], tmp_path / "list.pt")
    assert_load_refused(mlp, tmp_path / "list.pt", "no state dict")
    torch.save({"0.weight": 3}, tmp_path / "ints.pt")
    assert_load_refused(mlp, tmp_path / "ints.pt", "no state dict")


@pytest.mark.parametrize("wrapper", ["state_dict", "model_state_dict", "model"])
def test_wrapped_state_dict_is_unwrapped(mlp, mlp_factory, mlp_input, tmp_path, wrapper):
    torch.save({wrapper: mlp_factory(seed=4).state_dict(), "epoch": 3}, tmp_path / "wrapped.pt")
    load_checkpoint(mlp, tmp_path / "wrapped.pt")
    assert torch.equal(collect(mlp, [mlp_input])[0], collect(mlp_factory(seed=4), [mlp_input])[0])


def test_save_refuses_to_overwrite_an_existing_file(mlp, mlp_factory, tmp_path, suffix):
    path = save_checkpoint(mlp, tmp_path / f"model{suffix}")
    content = path.read_bytes()
    with pytest.raises(surgery.ConfigError, match="already exists"):
        save_checkpoint(mlp_factory(seed=1), path)
    assert path.read_bytes() == content
    save_checkpoint(mlp_factory(seed=1), path, overwrite=True)
    assert path.read_bytes() != content


def test_save_creates_parent_directories(mlp, tmp_path):
    path = save_checkpoint(mlp, tmp_path / "a" / "b" / "model.safetensors")
    assert path.is_file()


def test_saved_tensors_are_copies_not_views_of_the_model(mlp, tmp_path):
    path = save_checkpoint(mlp, tmp_path / "model.pt")
    with torch.no_grad():
        mlp[0].weight.add_(1.0)
    assert not torch.equal(read_state_dict(path)["0.weight"], mlp[0].weight)


def test_torch_save_failing_on_a_full_disk_is_an_os_error_and_leaves_nothing(tmp_path):
    def fails_like_a_full_disk(tmp):  # what torch.save raises when the disk fills (torch 2.x)
        tmp.write_bytes(b"part")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file")

    with pytest.raises(OSError, match=r"PytorchStreamWriter|inline_container") as raised:
        write_atomically(tmp_path / "model.pt", fails_like_a_full_disk)
    assert raised.value.errno in (errno.ENOSPC, errno.EIO) and isinstance(raised.value.__cause__, RuntimeError)
    assert list(tmp_path.iterdir()) == []
