"""The fused CPU ops (kernels/cpu_fused.cpp) against their torch references, and the dispatch rule."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

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


@pytest.fixture(scope="module")
def attention_ext(ext):
    """The extension, where its paged_attention runs on this CPU (AVX2 with FMA, or AVX-512F)."""
    if not ext.attention_lanes():
        pytest.skip("this CPU has neither AVX2 with FMA nor AVX-512F: the attention's reference runs")
    return ext


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


@pytest.mark.parametrize("width", [1, 3, 4, 5, 8, 9, 16, 17, 33, 2048, 2049])
def test_argmax_gives_torch_argmax_integers_with_ties_nans_and_infinities(ext, width):
    """The first maximum of each row (ties inside a vector lane, across lanes and in the tail), a
    row's first NaN wherever it is, rows of -inf; every width around the 4-, 8- and 16-lane vectors."""
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


def _attention_case(B: int, Q: int, H: int, Hkv: int, D: int, S: int, window: int | None = None, seed: int = 0):
    """Queries, a cache of 3 * S * B rows, each sequence's S rows (runs and scattered rows) and their
    positions: S - Q cached keys (some not readable, -1; the last two a shorter sequence's padding),
    then the chunk's own Q keys at the queries' positions (one padded query in the middle sequence,
    which sees every key)."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(3 * S * B + 5, 2, Hkv, D, generator=g)
    q = torch.randn(B, Q, H, D, generator=g)
    rows = torch.stack([torch.randperm(cache.shape[0], generator=g)[:S] if b % 2 else
                        torch.arange(b * S, (b + 1) * S) for b in range(B)])
    M = S - Q
    starts = torch.randint(M // 2, M + 6, (B,), generator=g)
    q_pos = starts[:, None] + torch.arange(Q)  # [B, Q]
    if Q > 1:
        q_pos[B // 2, -1] = -1
    old_pos = starts[:, None] - M + torch.arange(M)  # [B, M]
    old_pos[(old_pos < 0) | (torch.rand(B, M, generator=g) < 0.2)] = -1
    if M > 3:
        old_pos[:, -2:] = -1
    shuffled = torch.stack([torch.randperm(M, generator=g) if b % 2 else torch.arange(M) for b in range(B)])
    key_pos = torch.cat((old_pos.gather(1, shuffled), q_pos), 1)  # [B, S]: the order rows come in is free
    return q, cache, rows, key_pos, q_pos, window


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("B,Q,H,Hkv,D,S", [(1, 1, 4, 2, 64, 1), (3, 1, 4, 2, 64, 70), (16, 6, 4, 2, 64, 330),
                                           (2, 4, 8, 2, 128, 37), (5, 9, 4, 4, 64, 23), (2, 20, 4, 2, 64, 150)])
def test_paged_attention_matches_attention_over_the_gathered_rows(attention_ext, B, Q, H, Hkv, D, S, window):
    """Every shape the decode step uses (one query per sequence, a k = 5 verify, head_dim 128, no
    GQA) and more queries than one vector holds (Q * H / Hkv > 16, or > 8 in AVX2's 8 lanes); full and
    windowed layers."""
    case = _attention_case(B, Q, H, Hkv, D, S, window)
    out = attention_ext.paged_attention(*case[:5], window or 0)
    assert close(out, cpu_fused.paged_attention_reference(*case))


def test_paged_attention_reads_strided_queries_and_a_cache_view(attention_ext):
    """The layer's q is a slice of its fused q/k tensor, and its cache a view from the layer's first
    row on (KVStore.kv_rows)."""
    q, cache, rows, key_pos, q_pos, _ = _attention_case(4, 6, 4, 2, 64, 40)
    qk = torch.cat((q, torch.randn(4, 6, 2, 64)), 2)  # [B, Q, H + Hkv, D]
    view = torch.cat((torch.randn(7, 2, 2, 64), cache))[7:]
    assert close(attention_ext.paged_attention(qk[:, :, :4], view, rows, key_pos, q_pos, 5),
                 cpu_fused.paged_attention_reference(q, cache, rows, key_pos, q_pos, 5))


def test_paged_attention_refuses_rows_outside_the_cache_and_shapes_it_does_not_take(attention_ext):
    q, cache, rows, key_pos, q_pos, _ = _attention_case(2, 1, 4, 2, 64, 8)
    with pytest.raises(RuntimeError, match="a row outside the cache"):
        attention_ext.paged_attention(q, cache, torch.where(rows == rows[1, 3], cache.shape[0], rows), key_pos, q_pos, 0)
    with pytest.raises(RuntimeError, match="head_dim 64 or 128"):
        attention_ext.paged_attention(q[..., :32].contiguous(), cache[..., :32].contiguous(), rows, key_pos, q_pos, 0)
    with pytest.raises(RuntimeError, match="key_pos: expected"):
        attention_ext.paged_attention(q, cache, rows, key_pos[:, :4].contiguous(), q_pos, 0)
    with pytest.raises(RuntimeError, match="q_pos: expected"):
        attention_ext.paged_attention(q, cache, rows, key_pos, q_pos.int(), 0)
    with pytest.raises(RuntimeError, match="window: expected"):
        attention_ext.paged_attention(q, cache, rows, key_pos, q_pos, -1)
    with torch.inference_mode():  # the dispatch point sends a head_dim it has no kernel for to the reference
        odd = (q[..., :32].contiguous(), cache[..., :32].contiguous(), rows, key_pos, q_pos, None)
        assert torch.equal(cpu_fused.paged_attention(*odd), cpu_fused.paged_attention_reference(*odd))


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


@pytest.mark.parametrize("projection", ["onednn", "blas"])
def test_the_model_runs_the_fused_ops_when_they_are_built(ext, monkeypatch, projection):
    """Projections packed for oneDNN: a layer's norms, q/k norm and RoPE run fused, one op each.
    Packed for BLAS (weights stored transposed, as the layer ops take them): each layer is two calls."""
    from baton.shared.model.checkpoint import load_model
    from baton.shared.model.dense_attention import DenseAttention
    from baton.shared.model.layers import onednn_packs
    if projection == "onednn" and not onednn_packs(torch.float32):
        pytest.skip("oneDNN does not prepack float32 weights on this CPU")
    calls = []
    monkeypatch.setattr(cpu_fused, "extension", lambda: _Counting(ext, calls))
    cpu_fused.available.cache_clear()
    try:
        model = load_model(projection=projection)
        calls.clear()
        ids = torch.arange(5, 21)
        with torch.inference_mode():
            model.logits(model.forward_hidden(ids, torch.arange(16), DenseAttention(model.cfg, 1, 16)))
    finally:
        cpu_fused.available.cache_clear()
    layers = model.cfg.num_hidden_layers
    if projection == "blas":
        assert calls.count("attention_input") == layers and calls.count("attention_output_mlp") == layers
        assert calls.count("rms_norm") == 1  # the final norm
        return
    assert calls.count("qk_norm_rope") == layers and calls.count("add_rms_norm") == layers
    assert calls.count("rms_norm") == layers + 1  # each layer's input norm, then the final norm


def test_the_engine_picks_greedy_tokens_and_accepts_drafts_with_the_fused_argmax_and_attention(attention_ext, monkeypatch):
    """Prefill's first token, each draft and each verify: the extension's argmax, and decode's
    attention the extension's paged_attention; the reply is the one torch.argmax and SDPA over the
    gathered rows give (BATON_KERNELS=torch would run those)."""
    from baton.shared.engine.local import LocalEngine
    from baton.shared.engine.runner import SpecConfig
    from baton.shared.model.checkpoint import load_model
    model = load_model()
    engine = LocalEngine(model, SpecConfig(draft_tokens=3))
    prompts = [list(range(5, 40)), list(range(100, 107))]
    calls = []
    monkeypatch.setattr(cpu_fused, "extension", lambda: _Counting(attention_ext, calls))
    cpu_fused.available.cache_clear()
    try:
        fused = [s.output for s in engine.generate(prompts, 12)]
        monkeypatch.setattr(cpu_fused, "takes", lambda x: False)
        reference = [s.output for s in engine.generate(prompts, 12)]
    finally:
        cpu_fused.available.cache_clear()
    assert fused == reference and all(len(out) == 12 for out in fused)
    assert calls.count("argmax") >= 1 + 3 + 1  # prefill; a step's 3 drafts and its verify
    assert calls.count("paged_attention") >= model.cfg.num_hidden_layers + 3  # a verify's layers, 3 drafts


def test_the_attention_runs_fused_where_the_cpu_has_a_build_for_it(ext, monkeypatch):
    """16 queries a vector with AVX-512F, 8 with AVX2 and FMA; the reference elsewhere."""
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    want = 16 if "avx512f" in flags else 8 if {"avx2", "fma"} <= set(flags) else 0
    assert cpu_fused.attention_lanes() == ext.attention_lanes() == want
    case = _attention_case(1, 2, 4, 2, 64, 9, None)
    for lanes in (ext.attention_lanes(), 0):
        calls = []
        monkeypatch.setattr(cpu_fused, "extension", lambda: _Counting(ext, calls))
        monkeypatch.setattr(cpu_fused, "attention_lanes", lambda: lanes)
        with torch.inference_mode():
            assert close(cpu_fused.paged_attention(*case), cpu_fused.paged_attention_reference(*case))
        assert ("paged_attention" in calls) == bool(lanes)


class _Counting:
    def __init__(self, ext, calls: list) -> None:
        self._ext, self._calls = ext, calls

    def __getattr__(self, name):
        self._calls.append(name)
        return getattr(self._ext, name)


@pytest.mark.parametrize("tokens", [1, 6, 97])
def test_the_two_layer_ops_equal_their_references_bit_for_bit(ext, tokens):
    """attention_input / attention_output_mlp run the same ops in the same order as the layer's
    Python path (kernels/cpu_fused.py's references): not close, equal."""
    d, H, Hkv, D, hidden = 256, 4, 2, 64, 640
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, d, generator=g)
    norm_w, post_w = torch.randn(d, generator=g), torch.randn(d, generator=g)
    qkv_wt = torch.randn(d, (H + 2 * Hkv) * D, generator=g) * 0.05
    qk_w = torch.randn(H + Hkv, D, generator=g)
    angles = torch.rand(tokens, D // 2, generator=g) * 6.28
    cos = torch.cat((angles, angles), -1).cos()[:, None, :]  # [T, 1, D] as Rotary hands them out
    sin = torch.cat((-angles.sin(), angles.sin()), -1)[:, None, :]
    o_wt, down_wt = torch.randn(H * D, d, generator=g) * 0.05, torch.randn(hidden, d, generator=g) * 0.05
    gate_up_wt = torch.randn(d, 2 * hidden, generator=g) * 0.05
    attention = torch.randn(tokens, H, D, generator=g)
    with torch.inference_mode():
        q, kv = ext.attention_input(x, norm_w, 1e-6, qkv_wt, qk_w, cos, sin, 1e-5, Hkv)
        ref_q, ref_kv = cpu_fused.attention_input_reference(x, norm_w, 1e-6, qkv_wt, qk_w, cos, sin, 1e-5, Hkv)
        out = ext.attention_output_mlp(x, attention, o_wt, post_w, 1e-6, gate_up_wt, down_wt)
        ref_out = cpu_fused.attention_output_mlp_reference(x, attention, o_wt, post_w, 1e-6, gate_up_wt, down_wt)
    assert q.shape == (tokens, H, D) and kv.shape == (tokens, 2, Hkv, D) and out.shape == (tokens, d)
    assert torch.equal(q, ref_q) and torch.equal(kv, ref_kv) and torch.equal(out, ref_out)


def test_a_layer_runs_fused_with_blas_projections_and_gives_the_module_path_bits(ext, monkeypatch):
    """With its projections packed for BLAS a decoder layer runs as the two fused ops around its
    attention. Its output is bitwise the module path's: the target's and the draft's hidden states
    over a dense batch, and an engine's whole generation over the KV store (prefill, speculative steps)."""
    from baton.shared.engine.local import LocalEngine
    from baton.shared.engine.runner import SpecConfig
    from baton.shared.model.checkpoint import load_model
    from baton.shared.model.dense_attention import DenseAttention
    from baton.shared.model.layers import DecoderLayer
    model = load_model(projection="blas")
    prompts = [list(range(5, 40)), list(range(100, 107)), list(range(300, 390))]
    ids = torch.randint(0, model.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(40).repeat(2)

    def run() -> tuple:
        with torch.inference_mode():
            dense = DenseAttention(model.cfg, 2, 40)
            hidden = model.forward_hidden(ids.view(-1), positions, dense)
            draft = model.draft_hidden(hidden, ids.view(-1), positions, dense)
            engine = LocalEngine(model, SpecConfig(draft_tokens=3))
            return hidden, draft, [(s.output, s.finish_reason) for s in engine.generate(prompts, 24)]

    calls = []
    monkeypatch.setattr(cpu_fused, "extension", lambda: _Counting(ext, calls))
    cpu_fused.available.cache_clear()
    try:
        fused = run()
        assert calls.count("attention_input") >= 2 * (model.cfg.num_hidden_layers + 1)
        monkeypatch.setattr(DecoderLayer, "_fused", lambda self, x: False)
        module = run()
    finally:
        cpu_fused.available.cache_clear()
    assert torch.equal(fused[0], module[0]) and torch.equal(fused[1], module[1])
    assert fused[2] == module[2] and all(len(out) == 24 for out, _ in fused[2])


@pytest.mark.parametrize("fused", [True, False])
def test_a_layer_asked_for_some_rows_gives_those_rows_of_the_whole_output(monkeypatch, fused):
    """`rows`: the output projection and MLP run for those tokens only (the draft's first forward
    wants each sequence's last token, the prefill's draft window none); the attention still sees
    every token, so those rows equal the whole forward's, in the fused and the module path."""
    from baton.shared.model.checkpoint import load_model
    from baton.shared.model.dense_attention import DenseAttention
    from baton.shared.model.layers import DecoderLayer
    model = load_model(projection="blas")
    if not fused:
        monkeypatch.setattr(DecoderLayer, "_fused", lambda self, x: False)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(40).repeat(2)
    rows = torch.tensor([39, 79, 5])
    with torch.inference_mode():
        dense = DenseAttention(model.cfg, 2, 40)
        hidden = model.forward_hidden(ids.view(-1), positions, dense)  # [80, d]
        whole = model.draft_hidden(hidden, ids.view(-1), positions, dense)
        some = model.draft_hidden(hidden, ids.view(-1), positions, dense, rows=rows)
        none = model.draft_hidden(hidden, ids.view(-1), positions, dense, rows=rows[:0])
    assert some.shape == (3, model.cfg.hidden_size) and none.shape == (0, model.cfg.hidden_size)
    assert torch.allclose(some, whole[rows], rtol=0, atol=1e-5)


def test_a_module_built_elsewhere_for_this_source_is_loaded_without_building(ext, tmp_path):
    """The container image compiles the ops in a build stage and ships only the module: a
    `<module name>.so` in PREBUILT is loaded as is (a fresh process, with an empty build cache),
    and one of another source's name is not."""
    prebuilt = tmp_path / "prebuilt"
    prebuilt.mkdir()
    shutil.copy(ext.__file__, prebuilt / "baton_cpu_fused_000000000000.so")  # another source's build
    probe = ("import sys, torch; from pathlib import Path; from baton.kernels import cpu_fused; "
             "cpu_fused.PREBUILT = Path(sys.argv[1]); sys.exit(0) if cpu_fused._prebuilt() is None else None; "
             "m = cpu_fused.extension(); x = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.5, -1.0, 0.25, 0.5]]); "
             "print(m.__file__, m.argmax(x).tolist())")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "empty-cache")}
    run = lambda: subprocess.run([sys.executable, "-c", probe, str(prebuilt)], capture_output=True, text=True,
                                 env=env, timeout=120)
    assert (done := run()).returncode == 0 and done.stdout == "", done.stderr  # nothing of this source's name
    shutil.copy(ext.__file__, prebuilt / f"{cpu_fused.module_name()}.so")
    done = run()
    assert done.stdout.split(maxsplit=1) == [str(prebuilt / f"{cpu_fused.module_name()}.so"), "[1, 0]\n"], done.stderr
    assert not (tmp_path / "empty-cache").exists()  # nothing was built


def test_a_lock_left_by_a_killed_build_is_removed_not_waited_for(ext, tmp_path):
    """torch guards a build with a `lock` file it removes at the end; a process killed while
    building leaves it, and torch's next build of the name waits for it forever (seen here: a
    worker killed mid-build, and every later start hung without a log line). `build` takes its
    own flock first, so a `lock` it finds is stale: it goes, and the build proceeds."""
    from torch.utils import cpp_extension
    where = tmp_path / "build"
    cached = Path(cpp_extension._get_build_directory(cpu_fused.module_name(), verbose=False))
    if (cached / f"{cpu_fused.module_name()}.so").exists():
        shutil.copytree(cached, where, ignore=shutil.ignore_patterns("lock", cpu_fused.BUILD_LOCK))  # current: no compile
    where.mkdir(exist_ok=True)
    (where / "lock").touch()  # as a killed build leaves it
    probe = ("import sys; from pathlib import Path; from baton.kernels import cpu_fused; "
             "print(cpu_fused.build(Path(sys.argv[1])).__file__)")
    done = subprocess.run([sys.executable, "-c", probe, str(where)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(where / f"{cpu_fused.module_name()}.so")
    assert "left by a build of the fused CPU ops that did not finish" in done.stderr
    assert not (where / "lock").exists()


def test_a_finished_build_from_another_checkout_is_loaded_without_compiling(ext, tmp_path):
    """torch's cache rebuilds whenever its build file names other paths (another checkout, another
    virtual environment: ~25 s on 2 cores, each time two of them take turns). A build that
    finished (its BUILT mark) is loaded as it is: the module's name already pins the source,
    torch's version and the flags."""
    from torch.utils import cpp_extension
    name = cpu_fused.module_name()
    cached = Path(cpp_extension._get_build_directory(name, verbose=False))
    where = tmp_path / "build"
    shutil.copytree(cached, where, ignore=shutil.ignore_patterns("lock", cpu_fused.BUILD_LOCK))
    assert (where / f"{name}{cpu_fused.BUILT}").exists()  # the session's build (`ext`) finished
    ninja_file = where / "build.ninja"
    ninja_file.write_text(ninja_file.read_text().replace(str(cpu_fused.SOURCE), "/elsewhere/kernels/cpu_fused.cpp"))
    before = (ninja_file.read_text(), (where / f"{name}.so").stat().st_mtime_ns)
    probe = ("import sys, torch; from pathlib import Path; from baton.kernels import cpu_fused; "
             "m = cpu_fused.build(Path(sys.argv[1])); x = torch.tensor([[1.0, 3.0, 3.0, -2.0], [0.5, -1.0, 0.25, 0.5]]); "
             "print(m.__file__, m.argmax(x).tolist())")
    done = subprocess.run([sys.executable, "-c", probe, str(where)], capture_output=True, text=True, timeout=120)
    assert done.stdout.split(maxsplit=1) == [str(where / f"{name}.so"), "[1, 0]\n"], done.stderr
    assert (ninja_file.read_text(), (where / f"{name}.so").stat().st_mtime_ns) == before  # not rebuilt

