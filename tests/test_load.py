"""hap.load_model (hap/load.py): a saved folder loads on SDPA in the asked dtype; every refusal names the cause."""

import json

import pytest
import torch

import hap
from hap.hub import resolve_device
from tiny_models import tiny_llava


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    model, processor = tiny_llava(layers=2)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def test_a_saved_folder_loads_for_inference_on_sdpa(folder):
    model, processor = hap.load_model(str(folder), device="cpu")
    assert not model.training and model.dtype == torch.float32 and next(model.parameters()).device.type == "cpu"
    assert model.config.text_config._attn_implementation == "sdpa"
    assert type(model).__name__ == "LlavaForConditionalGeneration" and processor.tokenizer is not None
    half, _ = hap.load_model(str(folder), device="cpu", dtype="bfloat16")
    assert half.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "kwargs, error, match",
    [(dict(device="gpu0"), ValueError, "device='gpu0' is not a torch device"),
     (dict(dtype="float33"), ValueError, "dtype='float33' is not a torch dtype")],
)
def test_bad_device_or_dtype(folder, kwargs, error, match):
    with pytest.raises(error, match=match):
        hap.load_model(str(folder), **kwargs)


def test_a_missing_folder_or_unknown_id_is_a_model_load_error(tmp_path):
    with pytest.raises(hap.ModelLoadError, match="cannot load hub id 'no-such/model'.*offline"):
        hap.load_model("no-such/model", device="cpu")
    with pytest.raises(hap.ModelLoadError, match="cannot load"):
        hap.load_model(str(tmp_path / "missing"), device="cpu")


def test_an_unsupported_architecture_is_refused_before_the_weights_load(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(hap.ModelLoadError, match=r"is a BertModel; HAP supports LlavaForConditionalGeneration"):
        hap.load_model(str(tmp_path), device="cpu")


def test_weights_without_safetensors_are_refused(folder, tmp_path):
    for f in folder.iterdir():
        if f.suffix != ".safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(hap.ModelLoadError, match="cannot load local folder"):
        hap.load_model(str(tmp_path), device="cpu")


def test_resolve_device():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="is not a torch device"):
        resolve_device("gpu0")
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU (cuda:0 on a machine without one)
    with pytest.raises(ValueError, match="this machine has (no CUDA GPU|cuda:0..cuda:)"):
        resolve_device(missing)
