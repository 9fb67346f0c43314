"""Speculative decoding, measured in one run on held-out prompts.

    python bench/spec.py --prompts 24 --prompt-len 160 --max-tokens 96 --repeats 3 --json out/spec.json

Part 1 (in-process engine, same step loop as decode): acceptance length and decode tokens/s with
speculation off and in each draft-state mode (transfer / rebuild / cold); acceptance length over
the first 16 generated tokens vs the whole request; bytes a transfer moves per request in
transfer vs rebuild mode; time decode spends in its first draft forward (rebuild recomputes the
window there). Part 2: decode tok/s of the in-process engine at batch 1, 8 and 32 (`--batches`),
speculation off and on, next to `transformers` batched greedy `generate` at the same batch size,
same prompts, same threads (`--threads`, what a worker gets), both warmed up; per step the host
syncs (`tolist`, `item`, `int(tensor)`, ...) and tensor ops, counted with torch's dispatcher and
torch.profiler, and where the step's time goes. Part 3 (whole system: nats-server, router, prefill,
decode, NIXL): one greedy stream with speculation on and off, measured as a client sees it (first
token chunk to last), next to `transformers` greedy generate on the same checkpoint and prompt.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import msgspec
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from baton.shared.config import WorkerSection
from baton.shared.engine.attention import StoreAttention
from baton.shared.engine.local import LocalEngine
from baton.shared.engine.runner import SpecConfig
from baton.shared.engine.sequence import Sequence
from baton.shared.kv.plan import make_plan
from baton.shared.kv.store import KVStore
from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR, load_model
from baton.shared.model.heldout import heldout_prompts
from baton.shared.model.tokenizer import TextTokenizer
from baton.shared.process import as_child_env

MODES = ("transfer", "rebuild", "cold")


def run_engine(model, prompts, max_tokens, spec: SpecConfig, batch: int) -> dict:
    engine = LocalEngine(model, spec)
    first_draft_s = [0.0]
    original = engine.runner._draft_chain

    def timed_chain(seqs, *args):  # time decode's first draft forward of each request
        fresh = any(s.stats.verify_steps == 0 for s in seqs)
        t0 = time.perf_counter()
        out = original(seqs, *args)
        if fresh:
            first_draft_s[0] += time.perf_counter() - t0
        return out
    engine.runner._draft_chain = timed_chain
    seqs, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        seqs += engine.run([Sequence(f"b{i}-{j}", p, max_tokens) for j, p in enumerate(prompts[i:i + batch])])
    seconds = time.perf_counter() - t0
    tokens = sum(len(s.output) for s in seqs)
    out = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds, "outputs": [s.output for s in seqs]}
    if spec.enabled:
        steps = sum(s.stats.verify_steps for s in seqs)
        out.update(acceptance_length=(sum(s.stats.accepted for s in seqs) + steps) / steps,
                   acceptance_length_first16=sum(s.stats.acceptance_length(16) for s in seqs) / len(seqs),
                   acceptance_length_mean_per_request=sum(s.stats.acceptance_length() for s in seqs) / len(seqs),
                   per_position=[sum(s.stats.accepted_at[j] for s in seqs) / steps for j in range(spec.draft_tokens)],
                   first_draft_forward_s=first_draft_s[0])
    return out


def transfer_bytes(model, prompt_len: int, k: int) -> dict:
    """Bytes one request of prompt_len tokens moves, by component, in transfer vs rebuild mode."""
    out = {}
    for mode in ("transfer", "rebuild"):
        kw = dict(mode="ring", num_pages=64, page_size=16, num_slots=2, max_draft_tokens=k)
        src = KVStore(model.cfg, draft_enabled=mode == "transfer", **kw)
        dst = KVStore(model.cfg, draft_enabled=True, **kw)
        plan = make_plan(src.manifest("p", "fp", role="prefill"), dst.manifest("d", "fp", role="decode"))
        src.allocate("r", prompt_len)
        dst.allocate("r", prompt_len + 8)
        src.extend("r", prompt_len)
        dst.extend("r", prompt_len)
        by_comp: dict[str, int] = {}
        for d in plan.descriptors(prompt_len, src.allocation("r"), dst.allocation("r")):
            by_comp[d.component_key] = by_comp.get(d.component_key, 0) + d.nbytes
        out[mode] = {"plan_draft_state": plan.draft_state, "bytes": sum(by_comp.values()), "by_component": by_comp}
    return out


class SyncCounter(TorchDispatchMode):
    """Counts every tensor op dispatched and every read of a tensor's value by the host
    (`_local_scalar_dense`: item/int/float/bool; plus `tolist`, patched)."""

    def __enter__(self):
        self.ops, self.syncs, self._tolist = 0, 0, torch.Tensor.tolist
        counter = self

        def tolist(t):
            counter.syncs += 1
            return counter._tolist(t)
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        return func(*args, **(kwargs or {}))


def step_counts(model, prompts, batch: int, k: int, steps: int = 5) -> dict:
    """Host syncs and tensor ops per decode step (spec on, k drafts) at this batch size, and the ops
    that build the step's attention metadata (StoreAttention: one build per forward, one for the
    whole draft chain), per build."""
    engine = LocalEngine(model, SpecConfig(True, k, "transfer"))
    seqs = [Sequence(f"c{i}", prompts[i % len(prompts)], 64) for i in range(batch)]
    engine.admit(seqs)
    engine.runner.step(seqs)
    build = StoreAttention.__init__
    meta = {"builds": 0, "ops": 0}

    def counted(self, *a, **kw):
        before = counter.ops
        build(self, *a, **kw)
        meta["builds"] += 1
        meta["ops"] += counter.ops - before
    StoreAttention.__init__ = counted
    try:
        with SyncCounter() as counter:
            for _ in range(steps):
                engine.runner.step(seqs)
    finally:
        StoreAttention.__init__ = build
    return {"batch": batch, "host_syncs_per_step": counter.syncs / steps, "ops_per_step": counter.ops / steps,
            "metadata_ops_per_build": meta["ops"] / max(1, meta["builds"]),
            "metadata_builds_per_step": meta["builds"] / steps, "layers": model.cfg.num_hidden_layers + 1}


def profile_step(model, prompt, k: int) -> str:
    engine = LocalEngine(model, SpecConfig(True, k, "transfer"))
    seq = Sequence("p", prompt, 400)  # never finishes within the 23 steps below
    engine.admit([seq])
    for _ in range(3):
        engine.runner.step([seq])  # warm up
    t0 = time.perf_counter()
    for _ in range(10):
        engine.runner.step([seq])
    per_step_ms = (time.perf_counter() - t0) * 100
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            engine.runner.step([seq])
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=44)
    return (f"one decode step (k={k}, batch 1, context ~{len(prompt) + 40}): {per_step_ms:.1f} ms "
            f"(torch.profiler over 10 steps, its own overhead included):\n{table}")


def decode_rate(model, prompts, batch: int, max_tokens: int, spec: SpecConfig) -> tuple[float, list[list[int]]]:
    """Decode tok/s of the in-process engine over `batch` sequences (prefill excluded)."""
    engine = LocalEngine(model, spec)
    seqs = [Sequence(f"r{i}", prompts[i % len(prompts)], max_tokens) for i in range(batch)]
    engine.admit(seqs)
    t0 = time.perf_counter()
    with torch.inference_mode():
        while active := [s for s in seqs if s.finish_reason is None]:
            engine.runner.step(active)
    seconds = time.perf_counter() - t0
    for s in seqs:
        engine.store.free(s.request_id)
    return sum(len(s.output) - 1 for s in seqs) / seconds, [s.output for s in seqs]


def hf_model(path: Path):
    import transformers
    transformers.logging.set_verbosity_error()  # it lists the MTP tensors it does not use
    return transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_batch_rate(hf, prompts, batch: int, max_tokens: int) -> tuple[float, list[list[int]]]:
    """transformers batched greedy generate: decode tok/s (the first token's forward excluded)."""
    ids = torch.tensor([prompts[i % len(prompts)] for i in range(batch)])  # equal lengths: no padding
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, **kw)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = hf.generate(ids, max_new_tokens=max_tokens, **kw)
        seconds = time.perf_counter() - t0 - first
    return batch * (max_tokens - 1) / seconds, out[:, ids.shape[1]:].tolist()


def batch_table(model, path: Path, prompts, batches: list[int], max_tokens: int, k: int, repeats: int) -> list[dict]:
    hf = hf_model(path)
    hf_batch_rate(hf, prompts, 1, 8)  # warm up
    decode_rate(model, prompts, 1, 8, SpecConfig(True, k, "transfer"))
    rows = []
    for batch in batches:
        best = {}
        for _ in range(repeats):  # interleaved, best of N
            for name, run in (("transformers", lambda: hf_batch_rate(hf, prompts, batch, max_tokens)),
                              ("baton_off", lambda: decode_rate(model, prompts, batch, max_tokens, SpecConfig(False))),
                              ("baton_mtp", lambda: decode_rate(model, prompts, batch, max_tokens,
                                                                SpecConfig(True, k, "transfer")))):
                rate, outputs = run()
                if rate > best.get(name, (0,))[0]:
                    best[name] = (rate, outputs)
        reference = best["transformers"][1]
        exact = all(o == r[:len(o)] for name in ("baton_off", "baton_mtp") for o, r in zip(best[name][1], reference))
        rows.append({"batch": batch, "exact": exact, **{f"{n}_tok_s": v[0] for n, v in best.items()}})
    return rows


def system_stream(path: Path, prompt, max_tokens: int, k: int, threads: int, repeats: int) -> dict:
    """One greedy stream at a time through a whole cluster, as a client sees it: decode tok/s from
    the first token chunk to the last (best of `repeats`, after a warm-up request)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from e2e_cluster import running_cluster
    from baton.proto import subjects
    from baton.proto.public import GenerateRequest, StreamChunk
    from baton.shared.bus import Bus

    async def stream(bus, n):
        sent, first, tokens, last = time.perf_counter(), None, [], None
        request = GenerateRequest(token_ids=prompt, max_tokens=n, stream=True)
        async with bus.stream_request(subjects.GENERATE, request, StreamChunk, timeout_per_message=120) as chunks:
            async for last in chunks:
                if last.token_ids and first is None:
                    first = time.perf_counter()
                tokens += last.token_ids
        done = time.perf_counter()
        return {"tokens": tokens, "decode_tok_s": (len(tokens) - 1) / (done - first), "ttft_ms": (first - sent) * 1000,
                "spec": msgspec.to_builtins(last.spec) if last.spec else {}}

    async def runs(url):
        async with await Bus.connect(url, "bench") as bus:
            await stream(bus, 8)
            return [await stream(bus, max_tokens) for _ in range(repeats)]
    out = {}
    for spec in ("mtp", "off"):
        worker_args = ["--spec", spec, "--draft-tokens", str(k), "--threads", str(threads)]
        with running_cluster(model=path, worker_args=worker_args) as cluster:
            out[spec] = max(asyncio.run(runs(cluster.nats_url)), key=lambda r: r["decode_tok_s"])
    return out


def main() -> None:
    as_child_env()  # transformers and the in-process engine get the malloc the system's workers get
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=WorkerSection().draft_tokens, help="draft tokens (default: the deployment's)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=128)
    ap.add_argument("--skip-system", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="engine runs per mode, interleaved; the fastest counts")
    ap.add_argument("--batches", default="1,8,32", help="batch sizes of the in-process decode comparison")
    ap.add_argument("--threads", type=int, default=2, help="torch threads: the engine here, transformers, and each worker")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    tok = TextTokenizer.load(args.model)
    prompts = heldout_prompts(tok, args.prompts, args.prompt_len, seed=11)
    result: dict = {"args": vars(args) | {"json": str(args.json), "model": str(args.model)}, "engine": {}}
    specs = {"off": SpecConfig(enabled=False), **{m: SpecConfig(True, args.k, m) for m in MODES}}
    for _ in range(args.repeats):  # interleaved, best of N: these machines are noisy
        for name, spec in specs.items():
            run = run_engine(model, prompts, args.max_tokens, spec, args.batch)
            if name not in result["engine"] or run["seconds"] < result["engine"][name]["seconds"]:
                result["engine"][name] = run
    reference = result["engine"]["off"].pop("outputs")
    for mode in MODES:
        assert result["engine"][mode].pop("outputs") == reference, f"{mode}: speculation changed greedy output"
    result["transfer_bytes"] = transfer_bytes(model, args.prompt_len, args.k)

    print(f"\nin-process engine, {args.prompts} held-out prompts of {args.prompt_len} tokens, {args.max_tokens} "
          f"new tokens, batch {args.batch}, k={args.k}")
    print(f"{'mode':<9} {'tau':>6} {'tau@16':>7} {'tok/s':>7} {'1st draft fwd s':>16}  per-position acceptance"
          f"  (best of {args.repeats} interleaved runs)")
    for mode in ("off",) + MODES:
        r = result["engine"][mode]
        tau = f"{r['acceptance_length']:.3f}" if mode != "off" else "-"
        early = f"{r['acceptance_length_first16']:.3f}" if mode != "off" else "-"
        first = f"{r['first_draft_forward_s']:.3f}" if mode != "off" else "-"
        per = " ".join(f"{a:.3f}" for a in r.get("per_position", []))
        print(f"{mode:<9} {tau:>6} {early:>7} {r['tok_s']:>7.1f} {first:>16}  {per}")
    t, c = result["engine"]["transfer"], result["engine"]["cold"]
    print(f"transfer vs cold: tau@16 {100 * (t['acceptance_length_first16'] / c['acceptance_length_first16'] - 1):+.1f}%, "
          f"whole request {100 * (t['acceptance_length'] / c['acceptance_length'] - 1):+.1f}%")
    for mode, b in result["transfer_bytes"].items():
        print(f"bytes per request ({mode}): {b['bytes']:,}  {b['by_component']}")

    batches = [int(b) for b in args.batches.split(",")]
    result["batches"] = batch_table(model, args.model, prompts, batches, args.max_tokens, args.k, args.repeats)
    result["step_counts"] = [step_counts(model, prompts, b, args.k) for b in batches]
    print(f"\ndecode tok/s (prefill excluded), {args.max_tokens} new tokens, {args.threads} threads, best of "
          f"{args.repeats}; transformers = batched greedy generate")
    print(f"{'batch':>5} {'transformers':>13} {'baton off':>10} {'baton mtp':>10} {'mtp/hf':>7} {'exact':>6}")
    for r in result["batches"]:
        print(f"{r['batch']:>5} {r['transformers_tok_s']:>13.1f} {r['baton_off_tok_s']:>10.1f} "
              f"{r['baton_mtp_tok_s']:>10.1f} {r['baton_mtp_tok_s'] / r['transformers_tok_s']:>6.2f}x {str(r['exact']):>6}")
    print(f"\nper decode step (k={args.k}): {'batch':>5} {'host syncs':>10} {'tensor ops':>10} "
          f"{'metadata builds':>15} {'metadata ops/build':>19}")
    for c in result["step_counts"]:
        print(f"{'':>22}{c['batch']:>5} {c['host_syncs_per_step']:>10.1f} {c['ops_per_step']:>10.0f} "
              f"{c['metadata_builds_per_step']:>15.0f} {c['metadata_ops_per_build']:>19.0f}")
    result["profile"] = profile_step(model, prompts[0], args.k)
    print("\n" + result["profile"])

    if not args.skip_system:
        prompt = prompts[0]
        hf_rate, hf_tokens = hf_batch_rate(hf_model(args.model), [prompt], 1, args.system_tokens)
        system = system_stream(args.model, prompt, args.system_tokens, args.k, args.threads, args.repeats)
        result["system"] = {"transformers_generate_tok_s": hf_rate,
                            **{k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in system.items()}}
        ours = system["mtp"]["tokens"]  # may end early at EOS, which the router stops on
        result["system"]["exact_vs_transformers"] = ours == hf_tokens[0][:len(ours)]
        print(f"\nsingle stream through the whole system ({args.system_tokens} tokens, prompt {len(prompt)}, "
              f"first token chunk to last, best of {args.repeats}; transformers decode-only, same threads):")
        print(f"  transformers generate: {hf_rate:.1f} tok/s")
        for spec in ("mtp", "off"):
            s = result["system"][spec]
            print(f"  baton spec {spec:<4}: {s['decode_tok_s']:.1f} tok/s ({s['decode_tok_s'] / hf_rate:.2f}x), "
                  f"ttft {s['ttft_ms']:.0f} ms, spec {s['spec']}")
        print(f"  greedy tokens identical to transformers: {result['system']['exact_vs_transformers']}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
