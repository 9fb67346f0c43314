"""Fused CPU ops for the decode step (`cpu_fused.cpp`), each with its torch reference.

At decode sizes a forward is mostly eager PyTorch's per-op cost: `F.rms_norm` of one row is 6-8
dispatched ops (~18 us here), a layer's q/k norm and RoPE a dozen more. These ops do the same
arithmetic in one call each (~2-4 us), on contiguous float32 CPU tensors:

    rms_norm(x, w, eps)                    x [N, d], w [d] -> w * x / rms(x)            [N, d]
    add_rms_norm(x, delta, w, eps)         -> (x + delta, rms_norm(x + delta, w, eps))  [N, d] x2
    qk_norm_rope(qkv, w, cos, sin, eps)    qkv [T, A, D], w [heads, D], cos/sin [T, D]
                                           -> the first `heads` heads normed and rotated [T, heads, D]
    argmax(x)                              x [..., V] -> [...] first index of each row's max (int64)
    paged_attention(q, cache, rows, key_pos, q_pos, window)
                                           q [B, Q, H, D], cache [R, 2, Hkv, D], rows and key_pos
                                           [B, S], q_pos [B, Q] -> attention of sequence b over
                                           cache[rows[b]], each query seeing the keys
                                           `attention.visible` allows [B, Q, H, D] (`attend` without
                                           gathering the rows or building a mask first)
    attention_input(x, ...)                a decoder layer up to its attention: input norm, QKV
                                           projection, q/k norms, RoPE -> q [T, H, D], kv [T, 2, Hkv, D]
    attention_output_mlp(x, attention, ...) the rest: output projection, residual, norm, SwiGLU
                                           MLP, residual -> [T, d]

paged_attention puts a sequence's query vectors in the lanes of one AVX-512 register (or AVX2's), so each
key costs one vector of FMAs for all of them and the softmax runs lane-wise (its exp is Cephes'
polynomial, ~1 ulp); it is 3-6x faster than the gather and SDPA it replaces (`bench/cpu_ops.py`).
argmax gives exactly torch.argmax's integers (ties: the first maximum; a NaN counts as the
maximum). Both keep a lane per row element (argmax) or per query (attention) in one register:
16 lanes with AVX-512, 8 with AVX2 (`attention_lanes`; the argmax also has a 4-lane SSE2 build),
picked by the CPU at load. The others agree with their references to float rounding (another summation order), as
oneDNN's or BLAS's GEMMs agree with F.linear. The two layer ops
call the other ops and ATen's GEMM, SiLU, product and sum in the layer's own order (projection
weights stored transposed, as `Linear.pack("blas")` keeps them): bitwise the same results as
their references, ~17 us faster per layer call than the same composition from Python
(docs/benchmarks.md). The extension is compiled by
torch.utils.cpp_extension the first time a process asks for it (~25 s on 2 cores;
`scripts/bootstrap.sh` does it once) and cached under
$TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions), under a name carrying a hash of the
source (torch's cache judges staleness by file times, which a copy can keep). A module of that
name in `prebuilt/` beside the source is loaded instead, without a compiler: the container image
builds one in a stage of its own (`Dockerfile`, `build(directory)`). Where it cannot be
built (no C++ compiler or ninja), or with BATON_KERNELS=torch (read once per process), or for tensors it does
not take (bfloat16, CUDA, non-contiguous, autograd), the references run: same results to
rounding, slower.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import time
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F

from baton.kernels.attention import attend, visible
from baton.kernels.dispatch import kernel_mode

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_fused.cpp")
PREBUILT = SOURCE.with_name("prebuilt")  # `<module name>.so` built elsewhere (the image's build stage)
BUILD_LOCK = "baton-build.flock"  # beside torch's own `lock` in the build directory (`build`)
BUILD_WAIT_S = 900.0  # a build takes ~25 s on 2 cores; past this, the references run
BUILT = ".built"  # `<module name>.built`: written once a build finished, beside its module
CFLAGS, LDFLAGS = ("-O3", "-fopenmp"), ("-fopenmp",)  # torch's build appends to the lists it is given: copies go


def module_name() -> str:
    """Named by what the module is built from: the source's content, torch's version (its
    headers and ABI) and the flags. torch's cache decides staleness by file times and by the
    paths in its build file (ninja): a copy that keeps an older time than the cached build would
    load that build, of other code, and another checkout or virtual environment (other paths)
    would compile it all again."""
    key = b"\0".join([SOURCE.read_bytes(), torch.__version__.encode(), " ".join(CFLAGS + LDFLAGS).encode()])
    return f"baton_cpu_fused_{hashlib.sha256(key).hexdigest()[:12]}"


def build(directory: Path | None = None):
    """Compile the ops (a no-op when the cached build is current) -> the module; its file is
    `<directory>/<module_name()>.so` when `directory` is given, else in torch's extension cache.
    A build that finished there (BUILT) is loaded as it is, whichever checkout made it: its name
    says what it was built from.

    torch guards a build with a `lock` file that it removes when the build ends; a process killed
    while building leaves it, and every later build of the name then waits for it forever (a
    worker that never logs a line). So builds take BUILD_LOCK (a flock, which the kernel drops
    with a dead holder) first: whoever holds it may remove a `lock` it finds, as no live build
    can own one."""
    import ninja  # the pip package: torch's build calls `ninja`, which may not be on PATH
    from torch.utils import cpp_extension
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    name = module_name()
    where = directory or Path(cpp_extension._get_build_directory(name, verbose=False))
    where.mkdir(parents=True, exist_ok=True)
    with _build_lock(where / BUILD_LOCK):
        stale = where / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build of the fused CPU ops that did not finish", stale)
            stale.unlink(missing_ok=True)
        finished = where / f"{name}{BUILT}"
        if finished.exists():
            return _load(where / f"{name}.so")
        module = cpp_extension.load(name, [str(SOURCE)], extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS),
                                    build_directory=str(where))
        finished.touch()
        return module


@contextlib.contextmanager
def _build_lock(path: Path, timeout_s: float = BUILD_WAIT_S) -> Iterator[None]:
    """Hold an exclusive flock on `path`; waits for another process's build, up to `timeout_s`."""
    with open(path, "a") as held:
        deadline, said = time.monotonic() + timeout_s, False
        while True:
            try:
                fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process held {path} for {timeout_s:g} s") from None
                if not said:
                    log.info("waiting for another process's build of the fused CPU ops (%s)", path)
                    said = True
                time.sleep(0.2)
        yield  # the lock goes with the file's close


def _prebuilt():
    """The module from PREBUILT, if a build of this source is there; else None."""
    path = PREBUILT / f"{module_name()}.so"
    return _load(path) if path.exists() else None


def _load(path: Path):
    """The extension module in `path` (`<module name>.so`)."""
    loader = importlib.machinery.ExtensionFileLoader(path.stem, str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(path.stem, path, loader=loader))
    loader.exec_module(module)
    return module


@functools.cache
def extension():
    """The compiled module: prebuilt, or built on first call (and cached on disk); None where it
    can be neither loaded nor built."""
    start = time.perf_counter()
    try:
        module = _prebuilt() or build()
    except Exception as exc:  # noqa: BLE001 - any build failure means: run the references
        log.warning("fused CPU ops unavailable, running their torch references: %s", str(exc).strip()[:500])
        return None
    log.info("fused CPU ops ready in %.1f s (%s)", time.perf_counter() - start, module.__file__)
    return module


@functools.cache
def available() -> bool:
    """Whether the fused ops run in this process: built, and not turned off by BATON_KERNELS=torch
    (read once, at the first call)."""
    return kernel_mode() != "torch" and extension() is not None


@functools.cache
def attention_lanes() -> int:
    """Queries per vector in the fused attention on this CPU: 16 with AVX-512F, 8 with AVX2 and FMA,
    0 (the reference runs) otherwise. (Its 16-lane kernel built for AVX2 spilled every accumulator:
    batch 15's attention 37.7 ms a step against the reference's 9.3; the 8-lane one is faster than
    the reference.)"""
    return extension().attention_lanes() if available() else 0


def takes(x: torch.Tensor) -> bool:
    """The op's main input decides; the others are its weights and tables, of the same dtype and
    device (the extension refuses anything else by name)."""
    return (x.dtype == torch.float32 and x.is_cpu and x.is_contiguous() and not torch.is_grad_enabled()
            and available())


# --- references --------------------------------------------------------------------------------
def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, computed in fp32."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), eps=eps)
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rms_norm_reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """As transformers' Qwen3RMSNorm (F.rms_norm with the weight is bitwise the same in fp32)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    return w * rms(x, eps)


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + delta
    return total, rms_norm_reference(total, w, eps)


def qk_norm_rope_reference(qkv: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           eps: float) -> torch.Tensor:
    heads, D = w.shape
    normed = rms(qkv[:, :heads], eps) * w  # [T, heads, D]
    cos, sin = cos.view(-1, 1, D), sin.view(-1, 1, D)  # [T, 1, D]: the same for every head
    return normed * cos + normed.roll(D // 2, dims=-1) * sin


def attention_input_reference(x: torch.Tensor, norm_w: torch.Tensor, norm_eps: float, qkv_wt: torch.Tensor,
                              qk_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, qk_eps: float,
                              kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """As shared/model/layers.py's SelfAttention up to the attention call (qkv_wt [d, (H + 2 Hkv) D])."""
    T, D, heads = x.shape[0], qk_w.shape[1], qk_w.shape[0] - kv_heads
    qkv = rms_norm(x, norm_w, norm_eps).mm(qkv_wt).view(T, heads + 2 * kv_heads, D)
    qk = qk_norm_rope(qkv, qk_w, cos, sin, qk_eps)  # [T, H + Hkv, D]
    return qk[:, :heads], torch.stack((qk[:, heads:], qkv[:, heads + kv_heads:]), 1)


def attention_output_mlp_reference(x: torch.Tensor, attention: torch.Tensor, o_wt: torch.Tensor, post_w: torch.Tensor,
                                   eps: float, gate_up_wt: torch.Tensor, down_wt: torch.Tensor) -> torch.Tensor:
    """As shared/model/layers.py's DecoderLayer after the attention call (weights stored transposed)."""
    hidden = down_wt.shape[0]
    total, normed = add_rms_norm(x, attention.flatten(1).mm(o_wt), post_w, eps)
    gate_up = normed.mm(gate_up_wt)  # [T, 2 * hidden]
    return total + (F.silu(gate_up[:, :hidden]) * gate_up[:, hidden:]).mm(down_wt)


def paged_attention_reference(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, key_pos: torch.Tensor,
                              q_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    B, S = rows.shape  # index_select, not cache[rows]: 4-5x faster on CPU (docs/benchmarks.md)
    return attend(q, cache.index_select(0, rows.view(-1)).view(B, S, *cache.shape[1:]),
                  visible(q_pos, key_pos, window)[:, None])


# --- dispatch points -----------------------------------------------------------------------------
def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    if takes(x):
        return extension().rms_norm(x, w, eps)
    return rms_norm_reference(x, w, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, w: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if takes(x):
        return extension().add_rms_norm(x, delta, w, eps)
    return add_rms_norm_reference(x, delta, w, eps)


def qk_norm_rope(qkv: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> torch.Tensor:
    if takes(qkv):
        return extension().qk_norm_rope(qkv, w, cos, sin, eps)
    return qk_norm_rope_reference(qkv, w, cos, sin, eps)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] -> [...]: torch.argmax(x, -1), the same integers (greedy tokens, acceptance)."""
    if takes(x):
        return extension().argmax(x)
    return x.argmax(-1)


def paged_attention(q: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor, key_pos: torch.Tensor,
                    q_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """q [B, Q, H, D], cache [R, 2, Hkv, D], rows and key_pos [B, S] int64 (the rows' positions, -1
    where not readable), q_pos [B, Q] int64 (-1: padding) -> [B, Q, H, D]: each sequence's queries
    over its cache rows, each seeing the keys `attention.visible` allows (no mask is built)."""
    if takes(cache) and attention_lanes() and q.dtype == torch.float32 and q.shape[-1] in (64, 128) and \
            q.stride(-1) == 1 and rows.is_contiguous() and key_pos.is_contiguous() and q_pos.is_contiguous():
        return extension().paged_attention(q, cache, rows, key_pos, q_pos, window or 0)
    return paged_attention_reference(q, cache, rows, key_pos, q_pos, window)


def attention_input(x: torch.Tensor, norm_w: torch.Tensor, norm_eps: float, qkv_wt: torch.Tensor, qk_w: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor, qk_eps: float, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, d] -> q [T, H, D] (normed, rotated), kv [T, 2, Hkv, D] (K normed and rotated, V)."""
    if takes(x) and takes(qkv_wt):
        return extension().attention_input(x, norm_w, norm_eps, qkv_wt, qk_w, cos, sin, qk_eps, kv_heads)
    return attention_input_reference(x, norm_w, norm_eps, qkv_wt, qk_w, cos, sin, qk_eps, kv_heads)


def attention_output_mlp(x: torch.Tensor, attention: torch.Tensor, o_wt: torch.Tensor, post_w: torch.Tensor,
                         eps: float, gate_up_wt: torch.Tensor, down_wt: torch.Tensor) -> torch.Tensor:
    """x [T, d], attention [T, H, D] -> the layer's output [T, d]."""
    if takes(x) and takes(attention) and takes(o_wt):
        return extension().attention_output_mlp(x, attention, o_wt, post_w, eps, gate_up_wt, down_wt)
    return attention_output_mlp_reference(x, attention, o_wt, post_w, eps, gate_up_wt, down_wt)
