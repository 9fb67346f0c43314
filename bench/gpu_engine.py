"""The engine on a device, in one run (issue 27): in-process decode tok/s in float32 and bfloat16
at each batch size, speculation off and on, and how greedy tokens agree with `transformers` on the
same device and dtype, between the dtypes, and between speculation on and off.

    python bench/gpu_engine.py --device cuda --json out/gpu/engine.json
    python bench/gpu_engine.py --device cpu --prompts 4 --max-tokens 16 --batches 1,4   # the harness, on CPU

Prompts are held-out text of `--prompt-len` tokens (default 96: above the window of 64, so both
sliding and full layers are exercised). tok/s is generated tokens over the wall time of
`LocalEngine.run` for each batch (prefill included; the same for every column), best of
`--repeats` after a warm-up run; `transformers` greedy `generate` runs one prompt at a time.
Agreement columns: `same` = prompts whose whole output is identical; `prefix` = mean share of the
output before the first differing token. In float32 the engine must equal `transformers`
(greedy exactness is defined there); in bfloat16 rounding differs between the two and between
batch shapes, so agreement is reported, not asserted. CUDA graphs are not built yet (issue 27):
every number here is eager.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from baton.shared.config import WorkerSection
from baton.shared.engine.local import LocalEngine
from baton.shared.engine.runner import SpecConfig
from baton.shared.engine.sequence import Sequence
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR, engine_device, load_model
from baton.shared.model.heldout import heldout_prompts
from baton.shared.model.tokenizer import TextTokenizer

DTYPES = ("float32", "bfloat16")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def generate(model, prompts, max_tokens: int, spec: SpecConfig, batch: int) -> tuple[float, list[list[int]]]:
    """(seconds, outputs) of greedy generation in batches of `batch`."""
    engine = LocalEngine(model, spec)
    outputs, device = [], model.device
    synchronize(device)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch):
        seqs = engine.run([Sequence(f"b{i}-{j}", p, max_tokens, device=device)
                           for j, p in enumerate(prompts[i:i + batch])])
        outputs += [s.output for s in seqs]
    synchronize(device)
    return time.perf_counter() - t0, outputs


def hf_generate(path: Path, prompts, max_tokens: int, dtype: str, device: torch.device) -> list[list[int]]:
    import transformers
    transformers.logging.set_verbosity_error()  # it lists the MTP tensors it does not use
    hf = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, do_sample=False)
            out.append(gen[0, len(p):].tolist())
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    def shared(x, y):
        n = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        return n / max(len(x), len(y), 1)
    return {"same": sum(x == y for x, y in zip(a, b)), "of": len(a),
            "prefix": sum(shared(x, y) for x, y in zip(a, b)) / max(len(a), 1)}


def measure(args, device: torch.device, prompts) -> dict:
    result = {"device": str(device), "rates": [], "agreement": {}}
    outputs: dict[tuple, list[list[int]]] = {}
    for dtype in DTYPES:
        model = load_model(args.model, dtype, device)
        for batch in args.batches:
            for spec in (SpecConfig(False, args.k), SpecConfig(True, args.k)):
                generate(model, prompts[:batch], args.max_tokens, spec, batch)  # warm-up
                best = None
                for _ in range(args.repeats):
                    seconds, out = generate(model, prompts, args.max_tokens, spec, batch)
                    best = seconds if best is None else min(best, seconds)
                outputs[dtype, batch, spec.enabled] = out
                tokens = sum(len(o) for o in out)
                result["rates"].append({"dtype": dtype, "batch": batch, "spec": "mtp" if spec.enabled else "off",
                                        "tok_s": tokens / best})
        hf = hf_generate(args.model, prompts, args.max_tokens, dtype, device)
        for batch in args.batches:
            for spec in (False, True):
                name = f"{dtype} b{batch} {'mtp' if spec else 'off'} vs transformers {dtype}"
                result["agreement"][name] = agreement(outputs[dtype, batch, spec], hf)
    for batch in args.batches:
        result["agreement"][f"bfloat16 b{batch}: mtp vs off"] = agreement(outputs["bfloat16", batch, True],
                                                                          outputs["bfloat16", batch, False])
        result["agreement"][f"b{batch} mtp: bfloat16 vs float32"] = agreement(outputs["bfloat16", batch, True],
                                                                             outputs["float32", batch, True])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 32])
    ap.add_argument("--k", type=int, default=WorkerSection().draft_tokens)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    device = engine_device(args.device)
    prompts = heldout_prompts(TextTokenizer.load(args.model), args.prompts, args.prompt_len, seed=7)
    result = measure(args, device, prompts)
    print(f"in-process decode on {device}, {args.prompts} prompts of {args.prompt_len} tokens, "
          f"{args.max_tokens} new, k={args.k}, eager (no CUDA graphs)")
    print(f"{'dtype':>9} {'batch':>5} {'spec':>4} {'tok/s':>9}")
    for r in result["rates"]:
        print(f"{r['dtype']:>9} {r['batch']:>5} {r['spec']:>4} {r['tok_s']:>9.1f}")
    print("greedy agreement (same = whole outputs identical; prefix = mean share before the first difference)")
    for name, a in result["agreement"].items():
        print(f"  {name:<44} same {a['same']:>3}/{a['of']:<3} prefix {a['prefix']:.3f}")
    fp32 = [a for name, a in result["agreement"].items() if name.startswith("float32")]
    result["float32_exact"] = all(a["same"] == a["of"] for a in fp32)
    print(f"float32 equal to transformers float32 on {device}: {result['float32_exact']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **result}, indent=2))
    raise SystemExit(0 if result["float32_exact"] else 1)


if __name__ == "__main__":
    main()
