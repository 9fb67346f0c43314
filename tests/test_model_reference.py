"""The target model against `transformers` Qwen3ForCausalLM on the shipped checkpoint."""
import os
import time
from pathlib import Path

import pytest
import torch

from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR, load_model
from baton.shared.model.dense_attention import DenseAttention
from baton.shared.model.layers import Linear, fastest_projection, onednn_packs

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.unit
MODEL_DIR = Path(os.environ.get("BATON_TEST_MODEL", DEFAULT_MODEL_DIR))


KERNELS = ["blas", "onednn"] if onednn_packs(torch.float32) else ["blas"]


@pytest.fixture(scope="module", params=KERNELS)
def ours(request):
    """The model with its projections on each kernel `load_model` may choose."""
    model = load_model(MODEL_DIR, projection=request.param)
    assert {m.kernel for m in model.modules() if isinstance(m, Linear)} == {request.param}
    return model


@pytest.fixture(scope="module")
def hf():
    return transformers.Qwen3ForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


def our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    L = ids.shape[0]
    with torch.no_grad():
        return model.logits(model.forward_hidden(ids, torch.arange(L), DenseAttention(model.cfg, 1, L)))


def prompt(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2000, (n,), generator=torch.Generator().manual_seed(seed))


def test_config_means_the_same_in_transformers(ours, hf):
    assert hf.config.sliding_window == ours.cfg.sliding_window
    assert list(hf.config.layer_types) == list(ours.cfg.layer_types)
    assert "sliding_attention" in hf.config.layer_types and "full_attention" in hf.config.layer_types


@pytest.mark.parametrize("length_in_windows", [0.5, 1, 4])
def test_logits_match_transformers(ours, hf, length_in_windows):
    L = int(ours.cfg.sliding_window * length_in_windows)
    ids = prompt(L, seed=L)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (ref - our_logits(ours, ids)).abs().max().item() <= 1e-4


def greedy(model, ids: torch.Tensor, n: int) -> list[int]:
    seq = ids.tolist()
    for _ in range(n):
        seq.append(int(our_logits(model, torch.tensor(seq))[-1].argmax()))
    return seq[len(ids):]


def test_greedy_64_tokens_identical(ours, hf):
    ids = prompt(3 * ours.cfg.sliding_window, seed=7)
    with torch.no_grad():
        ref = hf.generate(ids[None], attention_mask=torch.ones_like(ids[None]), max_new_tokens=64,
                          do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
    assert greedy(ours, ids, 64) == ref


def layer_outputs(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Hidden state after each target layer at the last position."""
    outs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outs.append(o[-1].clone())) for layer in model.model.layers]
    try:
        our_logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return outs


def test_window_boundary_token_flip(ours):
    """Flip the token exactly W positions before the last query: the first sliding layer must not
    see it (it is outside p-W+1..p), the first full layer must; the token at W-1 is seen by both."""
    cfg = ours.cfg
    W, L = cfg.sliding_window, 2 * cfg.sliding_window
    first_sliding = cfg.layer_types.index("sliding_attention")
    first_full = cfg.layer_types.index("full_attention")
    assert first_sliding < first_full, "test assumes a sliding layer before the first full layer"
    ids = prompt(L, seed=3)
    base = layer_outputs(ours, ids)
    for distance, sliding_changes in ((W, False), (W - 1, True)):
        flipped = ids.clone()
        flipped[L - 1 - distance] = (flipped[L - 1 - distance] + 1) % cfg.vocab_size
        outs = layer_outputs(ours, flipped)
        changed = [not torch.equal(a, b) for a, b in zip(base, outs)]
        assert changed[first_sliding] is sliding_changes, f"distance {distance}"
        assert changed[first_full], f"distance {distance}: full layer must see every earlier token"


def test_auto_projection_picks_a_timed_kernel_and_packs_every_projection_for_it():
    model = load_model(MODEL_DIR)
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert model.projection in KERNELS
    assert {m.kernel for m in linears} == {model.projection}
    kernel, seconds = fastest_projection(linears, model.projection_probe())
    assert set(seconds) == set(KERNELS) and kernel == min(seconds, key=seconds.get)
    assert {m.kernel for m in linears} == {kernel}
    x = torch.randn(5, model.cfg.hidden_size)
    with torch.no_grad():
        for m in linears[:3]:
            if m.in_features == x.shape[1]:
                assert torch.allclose(m(x), torch.nn.functional.linear(x, m.weight), atol=1e-5)
    with pytest.raises(ValueError, match="projection kernel must be one of"):
        linears[0].pack("mkl")


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.skipif(len(KERNELS) < 2, reason="oneDNN does not prepack float32 here: one candidate")
@pytest.mark.parametrize("slow", KERNELS)
def test_the_kernel_whose_work_takes_more_cpu_time_loses_even_if_the_other_is_interrupted_once(slow):
    """The pick follows the CPU time of the work timed, best of several turns each: a kernel that
    costs twice as much loses, also when the other one's first turn was slowed by a burst of load."""
    model = load_model(MODEL_DIR, projection="blas")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    turns = []

    def run(rows: int) -> None:
        kernel = linears[0].kernel
        turns.append(kernel)
        burst = 0.02 if kernel != slow and turns.count(kernel) == 3 else 0.0  # its first timed turn, rows 1
        _spin((0.004 if kernel == slow else 0.002) + burst)
    kernel, seconds = fastest_projection(linears, run, rows=(1, 16), rounds=3)
    assert kernel != slow and seconds[slow] > seconds[kernel]
    assert turns == [k for _ in range(1 + 3) for k in ("onednn", "blas") for _ in (1, 16)]  # warm-up, then turns
    assert {m.kernel for m in linears} == {kernel}


@pytest.mark.skipif("onednn" not in KERNELS, reason="oneDNN does not prepack float32 here")
def test_the_projection_probe_runs_every_projection_of_the_model():
    """Unfused (oneDNN), the probe calls each projection, the layers' and those outside them."""
    model = load_model(MODEL_DIR, projection="onednn")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    called = set()
    for m in linears:
        m.forward = (lambda f, m: lambda x: (called.add(id(m)), f(x))[1])(m.forward, m)
    with torch.inference_mode():
        model.projection_probe()(1)
    assert called == {id(m) for m in linears}
