"""`worker.device` and `worker.dtype` reach every engine tensor (issue 27).

On this machine the device is the CPU, so where a tensor is made is checked in the source: every
tensor factory in the serving path names its device (parameters and buffers built in a module's
`__init__` move with the model instead). The dtype is checked by running: a bfloat16 engine runs
every projection and every attention in bfloat16 and keeps its KV cache in it."""
from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from baton.shared.engine.local import LocalEngine
from baton.shared.engine.runner import SpecConfig
from baton.shared.engine.sampling import SamplingParams
from baton.shared.engine.sequence import Sequence
from baton.shared.model.checkpoint import CheckpointError, engine_device, engine_dtype, load_model
from baton.shared.model.layers import onednn_packs

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
SERVING_PATH = ("shared/engine", "shared/kv", "shared/model/model.py", "shared/model/layers.py",
                "shared/model/checkpoint.py", "services/prefill", "services/decode", "services/aggregated",
                "kernels")
FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "linspace", "rand", "randn",
             "randint", "randperm", "Generator"}


def serving_files() -> list[Path]:
    out = []
    for part in SERVING_PATH:
        path = ROOT / part
        out += sorted(path.glob("*.py")) if path.is_dir() else [path]
    return out


def factories_without_a_device(source: str, name: str, model_code: bool) -> list[str]:
    """`torch.<factory>(...)` calls with no `device=` in `source`, outside the `__init__` of a
    model module (`model_code`: parameters and buffers there move with the model)."""
    found = []

    def visit(node: ast.AST, in_init: bool) -> None:
        for child in ast.iter_child_nodes(node):
            init = in_init or (model_code and isinstance(child, ast.FunctionDef) and child.name == "__init__")
            if (isinstance(child, ast.Call) and isinstance(child.func, ast.Attribute)
                    and child.func.attr in FACTORIES and isinstance(child.func.value, ast.Name)
                    and child.func.value.id == "torch" and not in_init
                    and not any(k.arg == "device" for k in child.keywords)):
                found.append(f"{name}:{child.lineno}: torch.{child.func.attr}(...)")
            visit(child, init)

    visit(ast.parse(source), False)
    return found


def test_every_tensor_factory_in_the_serving_path_names_its_device():
    files = serving_files()
    assert len(files) > 20 and ROOT / "shared/engine/runner.py" in files
    missing = [hit for path in files for hit in factories_without_a_device(
        path.read_text(), str(path.relative_to(ROOT)), path.parent.name == "model")]
    assert missing == [], "make these on the engine's device (or say device=\"cpu\" for host bookkeeping)"


def test_the_check_finds_a_factory_without_a_device():
    source = ("import torch\n\nclass Layer:\n    def __init__(self, n):\n        self.w = torch.ones(n)\n\n"
              "    def forward(self, n):\n        return torch.zeros(n), torch.ones(n, device='cpu')\n")
    assert factories_without_a_device(source, "engine.py", model_code=False) == [
        "engine.py:5: torch.ones(...)", "engine.py:8: torch.zeros(...)"]
    assert factories_without_a_device(source, "layers.py", model_code=True) == ["layers.py:8: torch.zeros(...)"]


class OpDtypes(TorchDispatchMode):
    """Counts the dtypes of the outputs of the heavy ops: projections and attention."""
    HEAVY = ("linear", "mm", "addmm", "bmm", "matmul", "scaled_dot_product", "_linear_pointwise")

    def __init__(self) -> None:
        super().__init__()
        self.seen: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if any(op in name for op in self.HEAVY):
            first = out[0] if isinstance(out, (tuple, list)) else out
            self.seen[(name.split(".")[1], first.dtype)] += 1
        return out


def test_a_bfloat16_engine_computes_and_stores_in_bfloat16():
    model = load_model(dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    engine = LocalEngine(model, SpecConfig(True, 3))
    assert {t.dtype for t in engine.store.data.values()} == {torch.bfloat16}
    assert engine.store.aux.dtype == torch.uint8  # the aux rows hold fp32 hidden states of any model
    seqs = [Sequence("greedy", [5, 6, 7] * 30, 12, SamplingParams(), device=engine.store.device),
            Sequence("sampled", [8, 9] * 50, 12, SamplingParams(temperature=0.8, seed=3), device=engine.store.device)]
    ops = OpDtypes()
    with ops:
        engine.run(seqs)
    # the kernel load_model timed fastest here: oneDNN's packed GEMM (only where this CPU packs
    # bfloat16: AVX-512 BW/VL/DQ) or mm over the transposed weight
    assert model.projection in (("onednn", "blas") if onednn_packs(torch.bfloat16) else ("blas",))
    projection = {"onednn": "_linear_pointwise", "blas": "mm"}[model.projection]
    assert {op for op, _ in ops.seen} >= {projection, "scaled_dot_product_attention"}, ops.seen
    assert {dtype for _, dtype in ops.seen} == {torch.bfloat16}, ops.seen
    assert all(len(s.output) == 12 and s.finish_reason == "length" for s in seqs)
    assert seqs[1].gen.device == engine.store.device


def test_a_device_this_torch_cannot_use_is_refused_by_name():
    assert engine_device("cpu") == torch.device("cpu") and engine_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(CheckpointError, match="dtype float16: expected float32 or bfloat16"):
        engine_dtype("float16")
    if torch.cuda.is_available():
        with pytest.raises(CheckpointError, match=r"device cuda:99: this process sees \d+ CUDA device"):
            engine_device("cuda:99")
    else:
        with pytest.raises(CheckpointError, match=r"device cuda: torch .* sees no CUDA device"):
            load_model(device="cuda")
