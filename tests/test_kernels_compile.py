"""The Triton kernels compile for a real GPU target (sm_90 cubin through the ptxas that ships with
triton), with no GPU here: the compiled path is checked, not only the interpreter's. Runs in a
subprocess because other kernel tests set TRITON_INTERPRET=1 in this process."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit
pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[test]')")


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    done = subprocess.run([sys.executable, "-m", "baton.kernels.compile_check", "--arch", "90"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("cubin") == 8, done.stdout
