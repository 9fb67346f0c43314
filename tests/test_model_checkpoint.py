"""Checkpoint loading fails early with an error that names the problem."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR, CheckpointError, load_model
from baton.shared.model.tokenizer import TextTokenizer

pytestmark = pytest.mark.unit


@pytest.fixture
def ckpt(tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(DEFAULT_MODEL_DIR, dst)
    return dst


def test_shipped_checkpoint_loads_with_mtp_weights():
    model = load_model()
    assert model.cfg.num_nextn_predict_layers == 1
    assert model.cfg.mtp_layer_types == ("sliding_attention",)
    assert "full_attention" in model.cfg.layer_types and "sliding_attention" in model.cfg.layer_types
    keys = load_file(str(DEFAULT_MODEL_DIR / "model.safetensors")).keys()
    assert any(k.startswith("mtp.layers.0.") for k in keys)
    assert sum((DEFAULT_MODEL_DIR / f).stat().st_size for f in ("model.safetensors", "tokenizer.json")) < 25e6


@pytest.mark.parametrize("missing", ["config.json", "model.safetensors", "tokenizer.json"])
def test_missing_file_is_named(ckpt, missing):
    (ckpt / missing).unlink()
    with pytest.raises(CheckpointError, match=missing):
        load_model(ckpt)


def test_layer_types_length_mismatch(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["layer_types"] = cfg["layer_types"][:-1]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="layer_types has 5 entries but num_hidden_layers is 6"):
        load_model(ckpt)


def test_unknown_attention_type(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["mtp_layer_types"] = ["chunked_attention"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"mtp_layer_types\[0\]"):
        load_model(ckpt)


def test_wrong_weight_shape_is_named(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    name = "model.layers.2.self_attn.k_proj.weight"
    tensors[name] = torch.zeros(3, 3)
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_model(ckpt)


def test_missing_weight_is_named(ckpt):
    tensors = load_file(str(ckpt / "model.safetensors"))
    del tensors["mtp.layers.0.eh_proj.weight"]
    save_file(tensors, str(ckpt / "model.safetensors"))
    with pytest.raises(CheckpointError, match="eh_proj"):
        load_model(ckpt)


@pytest.mark.parametrize("text", ["", "To be, or not to be", "naïve café — 東京 🎭\n\ttabs", "\x00\x7f bytes"])
def test_tokenizer_round_trips_utf8(text):
    tok = TextTokenizer.load(DEFAULT_MODEL_DIR)
    assert tok.decode(tok.encode(text)) == text
    assert 1000 <= tok.vocab_size <= 4096
