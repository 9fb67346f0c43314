#!/usr/bin/env bash
# Create .venv (if missing) and install Baton with everything its tests need.
# torch goes first, pinned to the CPU build (2.13.0): any other spec would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[transfer,test]" 2>&1 | grep -v "^WARNING: Location" || true
# Baton's own modules to bytecode, once: where PYTHONDONTWRITEBYTECODE is set (as on these machines),
# every process would compile them again as it starts (~0.6 s of CPU each: services, CLI, tests)
.venv/bin/python -m compileall -q baton services shared proto kernels > /dev/null
# the fused CPU ops are compiled once here (~25 s; cached), not by the first worker that loads the model
.venv/bin/python -c "from baton.kernels import cpu_fused; print('baton: fused CPU ops', 'built' if cpu_fused.available() else 'unavailable (the torch references run)')"
.venv/bin/python -c "import torch, nixl_cu12, nats, baton; print('baton: environment ready (torch', torch.__version__ + ')')"
