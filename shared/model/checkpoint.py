"""Load and save a Baton checkpoint: a Hugging Face directory with config.json,
model.safetensors (MTP weights under `mtp.`) and tokenizer.json. Never downloads anything."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from baton.shared import config
from baton.shared.kv.manifest import fingerprint as manifest_fingerprint

from .config import ConfigError, ModelConfig
from .model import BatonLM

CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json")
DEFAULT_MODEL_DIR = config.DEFAULT_MODEL_DIR  # the shipped checkpoint: one definition, in the torch-free config


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message names the problem."""


def check_files(path: Path) -> None:
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {path}")
    missing = [name for name in CHECKPOINT_FILES if not (path / name).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing {', '.join(missing)}")


def load_weights(model: BatonLM, weights_path: Path) -> None:
    expected = model.state_dict()
    if model.cfg.tie_word_embeddings:
        expected.pop("lm_head.weight")
    with safe_open(str(weights_path), framework="pt") as f:
        stored = set(f.keys())
        missing = sorted(set(expected) - stored)
        if missing:
            raise CheckpointError(f"{weights_path} lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
        unexpected = sorted(stored - set(expected) - {"lm_head.weight"})
        if unexpected:
            raise CheckpointError(f"{weights_path} has tensors the config does not describe: {unexpected[:3]}")
        with torch.no_grad():
            for name, param in expected.items():
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise CheckpointError(
                        f"{weights_path}: tensor {name} has shape {tuple(tensor.shape)}, "
                        f"config.json implies {tuple(param.shape)}")
                param.copy_(tensor)


def engine_device(name: str | torch.device) -> torch.device:
    """The device `worker.device` names, refused by name when this torch cannot use it."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise CheckpointError(f"device {name}: torch {torch.__version__} sees no CUDA device "
                                  "(a CPU build of torch, or no GPU visible to this process)")
        if (device.index or 0) >= torch.cuda.device_count():
            raise CheckpointError(f"device {name}: this process sees {torch.cuda.device_count()} CUDA "
                                  "device(s)")
    elif device.type != "cpu":
        raise CheckpointError(f"device {name}: only cpu and cuda are supported")
    return device


def engine_dtype(name: str | torch.dtype) -> torch.dtype:
    """The dtype `worker.dtype` names: float32 or bfloat16."""
    dtype = name if isinstance(name, torch.dtype) else getattr(torch, str(name), None)
    if dtype not in (torch.float32, torch.bfloat16):
        raise CheckpointError(f"dtype {name}: expected float32 or bfloat16")
    return dtype


def load_model(path: str | Path = DEFAULT_MODEL_DIR, dtype: str | torch.dtype = torch.float32,
               device: str | torch.device = "cpu", projection: str = "auto") -> BatonLM:
    """The checkpoint's model in `dtype` on `device`, in eval mode, projections packed for the
    `projection` kernel (CPU; "auto": the fastest here, see `Linear`)."""
    path = Path(path)
    check_files(path)
    try:
        cfg = ModelConfig.load(path)
    except ConfigError as exc:
        raise CheckpointError(f"{path / 'config.json'}: {exc}") from exc
    model = BatonLM(cfg)
    load_weights(model, path / "model.safetensors")
    return model.to(engine_device(device), engine_dtype(dtype)).eval().pack(projection)


def save_model(model: BatonLM, path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(model.cfg.to_hf_dict(), indent=2) + "\n")


def fingerprint(path: str | Path = DEFAULT_MODEL_DIR) -> str:
    """Hash of config.json and the weights file: workers must agree on it to exchange state."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    return manifest_fingerprint(config, (path / "model.safetensors").read_bytes())
