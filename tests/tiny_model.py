"""A randomly initialised model of the real structure (sliding and full layers, an MTP layer),
small enough for unit tests of the engine."""
import torch

from baton.shared.model.config import FULL, SLIDING, ModelConfig
from baton.shared.model.dense_attention import DenseAttention
from baton.shared.model.model import BatonLM


def tiny_model(vocab: int, layer_types=(SLIDING, FULL, SLIDING, FULL), window: int = 8, seed: int = 0,
               std: float = 0.3) -> BatonLM:
    cfg = ModelConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=len(layer_types),
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, layer_types=tuple(layer_types),
                      sliding_window=window, num_nextn_predict_layers=1, mtp_layer_types=(SLIDING,))
    torch.manual_seed(seed)
    model = BatonLM(cfg)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=std)
    return model.eval()


@torch.no_grad()
def dense_logits(model: BatonLM, ids: list[int]) -> torch.Tensor:
    """No-cache logits [L, V] of a whole sequence: the reference the cached paths must equal."""
    L = len(ids)
    h = model.forward_hidden(torch.tensor(ids), torch.arange(L), DenseAttention(model.cfg, 1, L))
    return model.logits(h)
