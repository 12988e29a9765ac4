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


# Kaggle mounts the models attached to a notebook under /kaggle/input, in one of two layouts.
HANDLE = "qwen-lm/qwen2.5/transformers/0.5b-instruct"


def _model_at(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_kaggle_models_in_the_documented_layout(tmp_path):
    mounted = _model_at(tmp_path / "qwen2.5" / "transformers" / "0.5b-instruct" / "1")
    assert model_source.find_kaggle_model(HANDLE, tmp_path) == mounted
    assert model_source.find_kaggle_model(HANDLE + "/1", tmp_path) == mounted
    assert model_source.find_kaggle_model(HANDLE + "/2", tmp_path) is None
    assert model_source.find_kaggle_model("qwen-lm/qwen2.5/transformers/1.5b-instruct", tmp_path) is None


def test_kaggle_models_under_models_owner_highest_version_any_case_one_subfolder(tmp_path):
    variation = tmp_path / "models" / "qwen-lm" / "Qwen2.5" / "Transformers" / "0.5b-instruct"
    _model_at(variation / "2")
    newest = _model_at(variation / "10" / "Qwen2.5-0.5B-Instruct")  # the files one folder down
    (variation / "11").mkdir()  # a version without a model in it is passed over
    assert model_source.find_kaggle_model(HANDLE, tmp_path) == newest
    assert model_source.find_kaggle_model(HANDLE + "/2", tmp_path) == variation / "2"
    _model_at(variation / "12" / "a")
    _model_at(variation / "12" / "b")  # two candidates: ambiguous, so not taken
    assert model_source.find_kaggle_model(HANDLE, tmp_path) == newest
    assert model_source.find_kaggle_model(HANDLE, tmp_path / "nothing-mounted") is None


def test_kaggle_models_under_two_spellings_of_one_framework(tmp_path):
    _model_at(tmp_path / "models" / "qwen-lm" / "qwen2.5" / "Transformers" / "7b-instruct" / "1")
    mounted = _model_at(tmp_path / "models" / "qwen-lm" / "qwen2.5" / "transformers" / "0.5b-instruct" / "1")
    assert model_source.find_kaggle_model(HANDLE, tmp_path) == mounted


def test_a_kaggle_handle_has_four_or_five_parts():
    for bad in ("qwen-lm/qwen2.5", "a/b/c/d/e/f", "a//c/d"):
        with pytest.raises(ValueError, match="owner/model/framework/variation"):
            model_source.find_kaggle_model(bad)
