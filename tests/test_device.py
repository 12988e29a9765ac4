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


def fake_card(monkeypatch, name, capability, archs, probe_error=None):
    """A CUDA machine faked on this CPU: its card, and the architectures this torch was built for."""
    from mini_infer import device as device_module

    monkeypatch.delenv(DEVICE_ENV, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: archs)
    probed = []

    def probe(index):
        probed.append(index)
        if probe_error:
            raise RuntimeError(probe_error)

    monkeypatch.setattr(device_module, "first_cuda_operation", probe)
    return probed


# Kaggle's torch (cu128) in 2026: machine code from Volta (sm_70) up, PTX for the newest.
KAGGLE_ARCHS = ["sm_70", "sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120"]


def test_auto_picks_a_card_this_torch_has_kernels_for(monkeypatch, recwarn):
    probed = fake_card(monkeypatch, "Tesla T4", (7, 5), KAGGLE_ARCHS)
    assert resolve_device("auto") == torch.device("cuda")
    assert probed == [0] and not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_auto_falls_back_to_the_cpu_on_a_p100_with_a_warning_naming_it(monkeypatch):
    probed = fake_card(monkeypatch, "Tesla P100-PCIE-16GB", (6, 0), KAGGLE_ARCHS)
    with pytest.warns(RuntimeWarning, match=r"Tesla P100-PCIE-16GB \(compute capability 6\.0, sm_60.*sm_70"):
        assert resolve_device("auto") == torch.device("cpu")
    assert probed == []  # refused from the list: no kernel launched on it
    # Asked for by name, CUDA is not second-guessed: the user gets what they asked for.
    assert resolve_device("cuda") == torch.device("cuda")


def test_auto_falls_back_when_the_first_operation_fails(monkeypatch):
    fake_card(monkeypatch, "Tesla T4", (7, 5), KAGGLE_ARCHS, probe_error="CUDA error: no kernel image is available")
    with pytest.warns(RuntimeWarning, match="first operation on the Tesla T4.*no kernel image"):
        assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize(
    ("arch", "capability", "runs"),
    [
        ("sm_75", (7, 5), True),
        ("sm_70", (7, 5), True),  # machine code runs on later minors of its major version
        ("sm_80", (7, 5), False),
        ("sm_80", (8, 6), True),
        ("sm_80", (9, 0), False),  # not across a major version
        ("sm_90a", (9, 0), True),  # architecture-specific: exactly 9.0
        ("sm_90a", (9, 1), False),
        ("sm_100f", (10, 3), True),
        ("compute_90", (12, 0), True),  # PTX: the driver compiles it for any later card
        ("compute_90", (8, 9), False),
        ("sm_60", (6, 0), True),
        ("nonsense", (6, 0), False),
    ],
)
def test_which_architectures_run_on_which_card(arch, capability, runs):
    from mini_infer.device import arch_runs_on

    assert arch_runs_on(arch, capability) is runs


def test_ptx_for_an_older_architecture_lets_a_newer_card_run(monkeypatch):
    fake_card(monkeypatch, "NVIDIA B200", (10, 0), ["sm_80", "sm_90", "compute_90"])
    assert resolve_device("auto") == torch.device("cuda")
    fake_card(monkeypatch, "NVIDIA B200", (10, 0), ["sm_80", "sm_90"])
    with pytest.warns(RuntimeWarning, match="NVIDIA B200"):
        assert resolve_device("auto") == torch.device("cpu")
