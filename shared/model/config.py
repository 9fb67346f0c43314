"""Model configuration: the fields of a Hugging Face `config.json` that Baton reads.

The per-layer attention type is metadata (`layer_types` for the target, `mtp_layer_types`
for the MTP draft layers); routing code reads these lists and never an architecture name.
"""
from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

SLIDING = "sliding_attention"
FULL = "full_attention"
ATTENTION_TYPES = (SLIDING, FULL)


class ConfigError(ValueError):
    """A config.json that cannot describe a model Baton can run."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int  # a sliding query at position p sees keys p-W+1 .. p (W keys)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    num_nextn_predict_layers: int = 0
    mtp_layer_types: tuple[str, ...] = ()
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    architectures: tuple[str, ...] = field(default=("Qwen3ForCausalLM",), compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"config.{name} must be a positive integer, got {getattr(self, name)!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"config.layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}; there must be exactly one attention type per layer")
        if len(self.mtp_layer_types) != self.num_nextn_predict_layers:
            raise ConfigError(
                f"config.mtp_layer_types has {len(self.mtp_layer_types)} entries but "
                f"num_nextn_predict_layers is {self.num_nextn_predict_layers}")
        for where, types in (("layer_types", self.layer_types), ("mtp_layer_types", self.mtp_layer_types)):
            for i, kind in enumerate(types):
                if kind not in ATTENTION_TYPES:
                    raise ConfigError(f"config.{where}[{i}] is {kind!r}; expected one of {ATTENTION_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")

    # --- layer numbering: target layers 0..N-1, draft (MTP) layers N..N+M-1 -----------------
    @property
    def num_draft_layers(self) -> int:
        return self.num_nextn_predict_layers

    def draft_layer_ids(self) -> list[int]:
        return [self.num_hidden_layers + j for j in range(self.num_nextn_predict_layers)]

    def attention_type(self, layer_id: int) -> str:
        """Attention type of a target layer (id < N) or a draft layer (id >= N)."""
        if layer_id < self.num_hidden_layers:
            return self.layer_types[layer_id]
        return self.mtp_layer_types[layer_id - self.num_hidden_layers]

    def window_of(self, layer_id: int) -> int | None:
        """Keys visible to a query: W for sliding layers, None (unbounded) for full ones."""
        return self.sliding_window if self.attention_type(layer_id) == SLIDING else None

    # --- (de)serialisation --------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known}
        rope = raw.get("rope_parameters") or {}
        if "rope_theta" not in values and "rope_theta" in rope:
            values["rope_theta"] = rope["rope_theta"]
        missing = [f.name for f in fields(cls)
                   if f.name not in values and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise ConfigError(f"config.json is missing required field(s): {', '.join(missing)}")
        for name in ("layer_types", "mtp_layer_types", "architectures"):
            if name in values:
                if not isinstance(values[name], (list, tuple)):
                    raise ConfigError(f"config.{name} must be a list, got {type(values[name]).__name__}")
                values[name] = tuple(values[name])
        if isinstance(values.get("eos_token_id"), list):
            values["eos_token_id"] = values["eos_token_id"][0]
        return cls(**values)

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ConfigError(f"model config not found: {path}")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
        return cls.from_dict(raw)

    def to_hf_dict(self) -> dict:
        """The config.json written next to the weights; `transformers` loads it as Qwen3."""
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["mtp_layer_types"] = list(self.mtp_layer_types)
        d["architectures"] = list(self.architectures)
        d.update(model_type="qwen3", use_sliding_window=True, max_window_layers=0,
                 hidden_act="silu", attention_bias=False, torch_dtype="float32",
                 rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta})
        return d

