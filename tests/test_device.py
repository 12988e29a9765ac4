"""Choosing the device and the dtype (chapter 00): the rules of ``"auto"`` and their refusals."""

import pytest
import torch

from mini_infer.device import DEVICE_ENV, resolve_device, resolve_dtype


def test_auto_follows_the_environment_variable_first(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert resolve_device("auto") == torch.device("cpu")
    monkeypatch.delenv(DEVICE_ENV)
    expected = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    monkeypatch.setenv(DEVICE_ENV, "nonsense")
    with pytest.raises(ValueError, match="is not a device"):
        resolve_device("auto")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "cuda")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("auto")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")


def test_dtypes():
    cpu = torch.device("cpu")
    assert resolve_dtype("fp16", cpu) == torch.float16 and resolve_dtype(torch.bfloat16, cpu) == torch.bfloat16
    assert resolve_dtype("auto", cpu) in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="not supported"):
        resolve_dtype("int8", cpu)


def test_to_device_builds_the_tensor_there():
    from mini_infer.device import to_device
    from tests.conftest import TEST_DEVICE

    got = to_device([[1, 2], [3, 4]], torch.long, TEST_DEVICE)
    assert got.device.type == TEST_DEVICE.type and got.dtype == torch.long and got.tolist() == [[1, 2], [3, 4]]
    assert to_device([], torch.float32, TEST_DEVICE).shape == (0,)
