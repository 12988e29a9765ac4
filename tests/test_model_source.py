import pytest

from mini_infer import model_source
from mini_infer.model_source import ModelNotFoundError, resolve_model


def test_local_directory_used_as_is(tiny_model_dir):
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model(tmp_path)


def test_file_instead_of_directory(tiny_model_dir):
    with pytest.raises(ModelNotFoundError, match="is a file"):
        resolve_model(tiny_model_dir / "config.json")


def test_nonsense_name(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither an existing directory"):
        resolve_model(str(tmp_path / "does-not-exist"))


def test_unreachable_hub_explains_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model("Qwen/Qwen2.5-0.5B-Instruct")
    message = str(info.value)
    assert "Qwen/Qwen2.5-0.5B-Instruct" in message and "pass that directory" in message


def test_shipped_name_resolves_to_package_dir(monkeypatch, tiny_model_dir):
    monkeypatch.setattr(model_source, "PACKAGE_MODELS_DIR", tiny_model_dir.parent)
    monkeypatch.setitem(model_source.SHIPPED_MODELS, "tiny", tiny_model_dir.name)
    assert resolve_model("tiny") == tiny_model_dir
