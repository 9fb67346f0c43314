"""The fused CPU ops (kernels/cpu_fused.cpp) against their torch references, and the dispatch rule."""
import shutil

import pytest
import torch

from baton.kernels import cpu_fused

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def ext():
    if cpu_fused.extension() is None:
        if shutil.which("c++") or shutil.which("g++"):
            pytest.fail("a C++ compiler is here but the fused CPU ops did not build (see the log)")
        pytest.skip("no C++ compiler: the references run instead")
    return cpu_fused.extension()


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rows", [1, 6, 97])
def test_rms_norm_and_its_residual_form_match_the_reference(ext, rows):
    g = torch.Generator().manual_seed(rows)
    x, delta = torch.randn(rows, 256, generator=g), torch.randn(rows, 256, generator=g)
    w = torch.randn(256, generator=g)
    with torch.inference_mode():
        assert close(ext.rms_norm(x, w, 1e-6), cpu_fused.rms_norm_reference(x, w, 1e-6))
        total, normed = ext.add_rms_norm(x, delta, w, 1e-6)
        ref_total, ref_normed = cpu_fused.add_rms_norm_reference(x, delta, w, 1e-6)
    assert torch.equal(total, ref_total) and close(normed, ref_normed)


@pytest.mark.parametrize("tokens", [1, 7])
def test_qk_norm_rope_matches_the_reference(ext, tokens):
    """qkv [T, H + 2Hkv, D]: the first H + Hkv heads are normed with their own weight rows and rotated
    by each token's cos / sin rows; the value heads are not touched."""
    H, Hkv, D = 4, 2, 64
    g = torch.Generator().manual_seed(tokens)
    qkv, w = torch.randn(tokens, H + 2 * Hkv, D, generator=g), torch.randn(H + Hkv, D, generator=g)
    angles = torch.rand(tokens, D // 2, generator=g) * 6.28
    cos = torch.cat((angles, angles), -1).cos()[:, None, :]  # [T, 1, D] as Rotary hands them out
    sin = torch.cat((-angles.sin(), angles.sin()), -1)[:, None, :]
    with torch.inference_mode():
        got = ext.qk_norm_rope(qkv, w, cos, sin, 1e-6)
        assert close(got, cpu_fused.qk_norm_rope_reference(qkv, w, cos, sin, 1e-6))
        assert got.shape == (tokens, H + Hkv, D)


@pytest.mark.parametrize("width", [1, 5, 16, 17, 33, 2048, 2049])
def test_argmax_gives_torch_argmax_integers_with_ties_nans_and_infinities(ext, width):
    """The first maximum of each row (ties inside a vector lane, across lanes and in the tail), a
    row's first NaN wherever it is, rows of -inf; every width around the 16-wide vectors."""
    g = torch.Generator().manual_seed(width)
    rows = [torch.randn(width, generator=g) for _ in range(8)]
    rows += [torch.randint(0, 3, (width,), generator=g).float() for _ in range(8)]  # many ties
    rows.append(torch.full((width,), float("-inf")))
    rows.append(torch.full((width,), 7.0))
    for at in {0, width // 2, width - 1}:
        nan = torch.randn(width, generator=g)
        nan[at] = float("nan")
        nan[-1] = float("nan")  # a later NaN too: the first one counts
        inf = torch.randn(width, generator=g)
        inf[at] = float("inf")
        rows += [nan, inf]
    x = torch.stack(rows)  # [R, width]
    with torch.inference_mode():
        assert torch.equal(ext.argmax(x), x.argmax(-1))
        assert torch.equal(ext.argmax(x.view(2, -1, width)), x.view(2, -1, width).argmax(-1))


def test_the_extension_refuses_what_it_does_not_compute_by_name(ext):
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="contiguous float32 CPU tensor"):
        ext.rms_norm(x.t().contiguous().t(), w, 1e-6)
    with pytest.raises(RuntimeError, match="w: expected 8 elements"):
        ext.rms_norm(x, torch.randn(4), 1e-6)


def test_dispatch_runs_the_reference_for_what_the_kernels_do_not_take(ext):
    """bfloat16, non-contiguous inputs and autograd go to the reference, bit for bit."""
    x, w = torch.randn(3, 256), torch.randn(256)
    with torch.inference_mode():
        low = x.bfloat16()
        low_w = w.bfloat16()
        assert torch.equal(cpu_fused.rms_norm(low, low_w, 1e-6), cpu_fused.rms_norm_reference(low, low_w, 1e-6))
        strided = torch.randn(256, 3).t()
        assert torch.equal(cpu_fused.rms_norm(strided, w, 1e-6), cpu_fused.rms_norm_reference(strided, w, 1e-6))
        assert torch.equal(cpu_fused.argmax(strided), strided.argmax(-1))
        assert torch.equal(cpu_fused.argmax(low), low.argmax(-1))
    w.requires_grad_(True)
    out = cpu_fused.rms_norm(x, w, 1e-6)
    assert out.grad_fn is not None  # the reference, differentiable


def test_the_model_runs_the_fused_ops_when_they_are_built(ext, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_fused, "extension", lambda: _Counting(ext, calls))
    cpu_fused.available.cache_clear()
    try:
        from baton.shared.model.checkpoint import load_model
        from baton.shared.model.dense_attention import DenseAttention
        model = load_model()
        ids = torch.arange(5, 21)
        with torch.inference_mode():
            model.logits(model.forward_hidden(ids, torch.arange(16), DenseAttention(model.cfg, 1, 16)))
    finally:
        cpu_fused.available.cache_clear()
    layers = model.cfg.num_hidden_layers
    assert calls.count("qk_norm_rope") == layers and calls.count("add_rms_norm") == layers
    assert calls.count("rms_norm") == layers + 1  # each layer's input norm, then the final norm


def test_the_engine_picks_greedy_tokens_and_accepts_drafts_with_the_fused_argmax(ext, monkeypatch):
    """Prefill's first token, each draft and each verify: the extension's argmax, and the reply is the
    one torch.argmax gives (BATON_KERNELS=torch would run that)."""
    from baton.shared.engine.local import LocalEngine
    from baton.shared.engine.runner import SpecConfig
    from baton.shared.model.checkpoint import load_model
    model = load_model()
    engine = LocalEngine(model, SpecConfig(draft_tokens=3))
    prompts = [list(range(5, 40)), list(range(100, 107))]
    calls = []
    monkeypatch.setattr(cpu_fused, "extension", lambda: _Counting(ext, calls))
    cpu_fused.available.cache_clear()
    try:
        fused = [s.output for s in engine.generate(prompts, 12)]
        monkeypatch.setattr(cpu_fused, "_takes", lambda x: False)
        reference = [s.output for s in engine.generate(prompts, 12)]
    finally:
        cpu_fused.available.cache_clear()
    assert fused == reference and all(len(out) == 12 for out in fused)
    assert calls.count("argmax") >= 1 + 3 + 1  # prefill; a step's 3 drafts and its verify


class _Counting:
    def __init__(self, ext, calls: list) -> None:
        self._ext, self._calls = ext, calls

    def __getattr__(self, name):
        self._calls.append(name)
        return getattr(self._ext, name)
