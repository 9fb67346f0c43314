"""Compile the Triton kernels ahead of time for a CUDA target, without a GPU (ptxas ships with
triton): catches compile errors that the interpreter never sees.

    python -m baton.kernels.compile_check [--arch 90] [--all]

Must run without TRITON_INTERPRET (the kernels must be real @triton.jit functions); the default
set is one fp32 windowed and one bf16 full-attention variant of the plain and the split-K attention
kernels, the split merge and pack; --all compiles every dtype x window.
"""
from __future__ import annotations

import argparse
import itertools
import os
import time


def _signature(fn, pointers: dict[str, str], floats=()) -> dict[str, str]:
    return {n: pointers.get(n, "fp32" if n in floats else "i32") for n in fn.arg_names}


def compile_kernels(arch: int = 90, every: bool = False) -> list[str]:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter's kernels cannot be compiled")
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from baton.kernels.chunk_attention_triton import (_chunk_attention_kernel,
                                                       _chunk_attention_split_kernel,
                                                       _combine_splits_kernel)
    from baton.kernels.pack_triton import _copy_rows_kernel

    target, done = GPUTarget("cuda", arch, 32), []
    dtypes = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}
    variants = ([(d, w) for d in dtypes for w in (False, True)] if every
                else [("fp32", True), ("bf16", False)])
    kernels = {"chunk_attention": _chunk_attention_kernel, "chunk_attention_split": _chunk_attention_split_kernel}
    for (name, windowed), (label, kernel) in itertools.product(variants, kernels.items()):
        ptrs = {n: f"*{name}" for n in ("Q", "KN", "VN", "KC", "VC", "OUT")}
        ptrs.update({n: "*i64" for n in ("QPOS", "OROWS", "OPOS")})
        ptrs.update({n: "*fp32" for n in ("PART_M", "PART_L", "PART_ACC")})  # split partials
        consts = dict(GROUP=4, GROUP_P=4, BLOCK_Q=4, BLOCK_N=32, BLOCK_D=128, WINDOWED=windowed,
                      DOT_DTYPE=dtypes[name])
        sig = _signature(kernel, ptrs, floats=("sm_scale_log2",))
        sig.update({k: "constexpr" for k in consts})
        t0 = time.perf_counter()
        k = triton.compile(ASTSource(kernel, sig, constexprs=consts), target=target,
                           options={"num_warps": 4})
        assert k.asm.get("cubin"), "no cubin"
        done.append(f"{label} {name} windowed={windowed}: sm_{arch} cubin, "
                    f"{k.metadata.shared} B shared, {time.perf_counter() - t0:.1f} s")
    for name in dict.fromkeys(name for name, _ in variants):
        consts = dict(BLOCK_R=16, BLOCK_D=128)
        sig = _signature(_combine_splits_kernel, {"PART_M": "*fp32", "PART_L": "*fp32",
                                                  "PART_ACC": "*fp32", "OUT": f"*{name}"})
        sig.update({k: "constexpr" for k in consts})
        k = triton.compile(ASTSource(_combine_splits_kernel, sig, constexprs=consts), target=target,
                           options={"num_warps": 4})
        assert k.asm.get("cubin"), "no cubin"
        done.append(f"combine_splits {name}: sm_{arch} cubin")
    for pack in (True, False):
        consts = dict(BLOCK=1024, PACK=pack)
        sig = _signature(_copy_rows_kernel, {"VIEW": "*i16", "STAGE": "*i16", "ROWS": "*i64"})
        sig.update({k: "constexpr" for k in consts})
        k = triton.compile(ASTSource(_copy_rows_kernel, sig, constexprs=consts), target=target,
                           options={"num_warps": 4})
        assert k.asm.get("cubin"), "no cubin"
        done.append(f"copy_rows pack={pack}: sm_{arch} cubin")
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    ap.add_argument("--all", action="store_true", help="every dtype x window variant")
    args = ap.parse_args()
    for line in compile_kernels(args.arch, args.all):
        print(line)


if __name__ == "__main__":
    main()
