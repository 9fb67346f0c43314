"""`baton bench`: a load harness that drives a running deployment over the public NATS API.

    baton bench --nats-url URL --requests 64 --concurrency 1,2,4,8 --json out/bench.json --plot out/
    baton bench --rate 2.5 --duration 60 --input-len 64:512 --max-tokens 32:128

Every request is a streaming `baton.v1.generate` (greedy unless --temperature; --draft-tokens N
caps speculation per request, 0 turns it off, to measure its effect on one deployment), timed on the
client as its chunks arrive (`time.perf_counter`), so the numbers are what a client sees:

- TTFT   request sent -> first chunk carrying tokens.
- ITL    inter-token latency: the gap between two consecutive chunks carrying tokens. With
         speculative decoding a chunk carries the 1..k+1 tokens of one verify step, so this is
         the stall a streaming reader sees, not a per-token average.
- TPOT   time per output token after the first: (last token chunk - first token chunk) / (n - 1),
         one value per request; a request's mean inter-token latency.
- E2E    request sent -> the finished chunk.
- output tokens/s and requests/s over the measured window (first request sent -> last ended);
  goodput: requests that succeeded with TTFT <= --slo-ttft-ms and TPOT (mean ITL) <= --slo-itl-ms.
- acceptance length: (sum accepted + sum verify_steps) / sum verify_steps over all requests,
  from the `spec` of each final chunk (tokens committed per target verify forward).
- errors by `BatonError` code (busy, timeout, ...).

Percentiles interpolate linearly between the two nearest ranks (`percentile` below; numpy's
default "linear" method). Arrivals: a fixed number of requests in flight (--concurrency), or an
open-loop Poisson process at --rate requests/s (optionally capped by --concurrency). A comma
list of either is a sweep: one run per value, one table and one JSON with the curve.

Prompts: slices of the held-out plays (bench/heldout.txt), tokenized with --model's tokenizer and
sent as token ids of exactly --input-len tokens, or the lines of --prompts-file sent as text.
Lengths are a value (128), a uniform range (64:512) or a uniform choice (32,1024).

Importable: `BenchConfig`, `run_bench(config)` (async; returns the JSON-ready result),
`format_report(result)`, `percentile`, `RequestRecord`, `summarize`; `add_arguments(parser)` and
`main(args)` are what `baton bench` calls.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from baton.proto import subjects
from baton.proto.errors import BatonError, ErrorCode
from baton.proto.public import GenerateRequest, StreamChunk, check_draft_tokens

STAT_KEYS = ("mean", "p50", "p90", "p99")


# --- statistics ------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) with linear interpolation between closest ranks:
    sort the n values x_0 <= ... <= x_{n-1}, take h = (n - 1) * q / 100, and return
    x_floor(h) + (h - floor(h)) * (x_floor(h)+1 - x_floor(h)). So p0 is the minimum, p100 the
    maximum, p50 the median; NaN for no values. (numpy.percentile's default, Hyndman-Fan type 7.)"""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    if not xs:
        return math.nan
    h = (len(xs) - 1) * q / 100
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def describe(values: Sequence[float]) -> dict[str, float | int]:
    """count, mean, p50, p90, p99, min, max (NaN when empty)."""
    n = len(values)
    return {"count": n, "mean": sum(values) / n if n else math.nan,
            **{f"p{q}": percentile(values, q) for q in (50, 90, 99)},
            "min": min(values) if n else math.nan, "max": max(values) if n else math.nan}


@dataclass
class RequestRecord:
    """One request as the client saw it; times are seconds since the run started (perf_counter)."""

    index: int
    sent: float
    prompt_tokens: int = 0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) of token-carrying chunks
    ended: float | None = None  # finished chunk or error arrival
    finish_reason: str | None = None
    error: str | None = None  # an ErrorCode value
    error_message: str = ""
    completion_tokens: int = 0  # usage.completion_tokens of the final chunk
    spec: dict[str, int] = field(default_factory=lambda: {"verify_steps": 0, "drafted": 0, "accepted": 0})

    @classmethod
    def from_timestamps(cls, sent: float, arrivals: Sequence[float], tokens: Sequence[int] | None = None,
                        ended: float | None = None, index: int = 0) -> "RequestRecord":
        """A completed request from chunk arrival times (and tokens per chunk, default 1 each)."""
        tokens = list(tokens) if tokens is not None else [1] * len(arrivals)
        chunks = list(zip(arrivals, tokens))
        return cls(index=index, sent=sent, chunks=chunks, finish_reason="length",
                   ended=ended if ended is not None else (arrivals[-1] if arrivals else sent),
                   completion_tokens=sum(tokens))

    @property
    def ok(self) -> bool:
        return self.error is None and self.ended is not None

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def ttft(self) -> float | None:
        return self.chunks[0][0] - self.sent if self.chunks else None

    @property
    def e2e(self) -> float | None:
        return self.ended - self.sent if self.ended is not None else None

    @property
    def itls(self) -> list[float]:
        return [b[0] - a[0] for a, b in zip(self.chunks, self.chunks[1:])]

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens
        return (self.chunks[-1][0] - self.chunks[0][0]) / (n - 1) if n > 1 else None

    def meets(self, slo_ttft_ms: float | None, slo_itl_ms: float | None) -> bool:
        if not self.ok:
            return False
        if slo_ttft_ms is not None and (self.ttft is None or self.ttft * 1000 > slo_ttft_ms):
            return False
        return slo_itl_ms is None or self.tpot is None or self.tpot * 1000 <= slo_itl_ms

    def as_dict(self) -> dict:
        plain = asdict(self)
        plain["chunks"] = [[round(t, 6), n] for t, n in self.chunks]
        return plain


def _ms(values: list[float | None]) -> dict:
    return describe([v * 1000 for v in values if v is not None])


def summarize(records: list[RequestRecord], duration_s: float | None = None,
              slo_ttft_ms: float | None = None, slo_itl_ms: float | None = None) -> dict:
    """The statistics of one run. `duration_s` defaults to first sent -> last ended."""
    ok = [r for r in records if r.ok]
    if duration_s is None:
        ends = [r.ended for r in records if r.ended is not None]
        duration_s = (max(ends) - min(r.sent for r in records)) if records and ends else 0.0
    tokens = sum(r.output_tokens for r in ok)
    verify = sum(r.spec["verify_steps"] for r in ok)
    accepted = sum(r.spec["accepted"] for r in ok)
    good = sum(r.meets(slo_ttft_ms, slo_itl_ms) for r in records)
    errors = collections.Counter(r.error for r in records if r.error is not None)
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    return {
        "requests": len(records), "completed": len(ok), "errors": dict(sorted(errors.items())),
        "finish_reasons": dict(sorted(collections.Counter(r.finish_reason for r in ok).items())),
        "duration_s": duration_s,
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": tokens,
        "requests_per_s": rate(len(ok)), "output_tokens_per_s": rate(tokens),
        "ttft_ms": _ms([r.ttft for r in ok]), "itl_ms": _ms([g for r in ok for g in r.itls]),
        "tpot_ms": _ms([r.tpot for r in ok]), "e2e_ms": _ms([r.e2e for r in ok]),
        "goodput": {"requests": good, "fraction": good / len(records) if records else math.nan,
                    "requests_per_s": rate(good), "slo_ttft_ms": slo_ttft_ms, "slo_itl_ms": slo_itl_ms},
        "spec": {"verify_steps": verify, "drafted": sum(r.spec["drafted"] for r in ok), "accepted": accepted},
        "acceptance_length": (accepted + verify) / verify if verify else None,
    }


# --- workload --------------------------------------------------------------------------------

@dataclass(frozen=True)
class LengthSpec:
    """A length: "128" (fixed), "64:512" (uniform integer range, inclusive), "32,1024" (choice)."""

    low: int
    high: int
    choices: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str | int) -> "LengthSpec":
        text = str(text).strip()
        try:
            if "," in text:
                values = tuple(int(v) for v in text.split(",") if v.strip())
                spec = cls(min(values), max(values), values)
            elif ":" in text:
                lo, hi = (int(v) for v in text.split(":", 1))
                spec = cls(lo, hi)
            else:
                spec = cls(int(text), int(text))
        except ValueError:
            raise ValueError(f"a length is N, LOW:HIGH or A,B,C (positive integers), got {text!r}") from None
        if spec.low < 1 or spec.high < spec.low:
            raise ValueError(f"a length must be >= 1 (and LOW <= HIGH), got {text!r}")
        return spec

    def draw(self, rng: random.Random) -> int:
        if self.choices:
            return rng.choice(self.choices)
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        if self.choices:
            return ",".join(map(str, self.choices))
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int] | None = None
    text: str | None = None
    max_tokens: int = 32

    @property
    def size(self) -> int:
        return len(self.token_ids) if self.token_ids is not None else 0


def make_prompts(n: int, input_len: LengthSpec, max_tokens: LengthSpec, *, prompts_file: Path | None = None,
                 model: Path | None = None, seed: int = 0) -> list[Prompt]:
    """`n` prompts: lines of `prompts_file` (cycled, sent as text; .jsonl lines may be
    {"prompt": ...}), else random slices of the held-out plays of `input_len` tokens."""
    rng = random.Random(seed)
    if prompts_file is not None:
        texts = _read_prompts(Path(prompts_file))
        return [Prompt(text=texts[i % len(texts)], max_tokens=max_tokens.draw(rng)) for i in range(n)]
    from baton.shared.model.checkpoint import DEFAULT_MODEL_DIR
    from baton.shared.model.heldout import HELDOUT_TEXT
    from baton.shared.model.tokenizer import TextTokenizer
    ids = TextTokenizer.load(model or DEFAULT_MODEL_DIR).encode(HELDOUT_TEXT.read_text())
    out = []
    for _ in range(n):
        length = input_len.draw(rng)
        if length >= len(ids):
            raise ValueError(f"--input-len {length} is longer than the held-out text ({len(ids)} tokens)")
        start = rng.randrange(0, len(ids) - length)
        out.append(Prompt(token_ids=ids[start:start + length], max_tokens=max_tokens.draw(rng)))
    return out


def _read_prompts(path: Path) -> list[str]:
    texts = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        if path.suffix == ".jsonl":
            item = json.loads(line)
            line = item["prompt"] if isinstance(item, dict) else str(item)
        texts.append(line)
    if not texts:
        raise ValueError(f"{path}: no prompts (one per non-empty line)")
    return texts


# --- the run ---------------------------------------------------------------------------------

@dataclass
class BenchConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    requests: int | None = 32  # per level; None: unbounded (then `duration_s` bounds the run)
    concurrency: list[int] | None = None  # levels of fixed in-flight requests (default [1]); with `rate`: one value, a cap
    rate: list[float] | None = None  # Poisson levels, requests/s
    duration_s: float | None = None  # stop sending new requests after this long (per level)
    input_len: str = "128"
    max_tokens: str = "32"
    prompts_file: Path | None = None
    model: Path | None = None  # tokenizer for the held-out prompts
    warmup: int = 2  # requests per level before measuring (not counted)
    temperature: float = 0.0
    top_p: float = 1.0
    draft_tokens: int | None = None  # each request's cap on speculation (None: the deployment's K)
    seed: int = 0  # workload seed; sampled requests get seed + index
    stop: list[str] = field(default_factory=list)
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    timeout_s: float = 120.0  # silence allowed between two chunks of one request
    progress: bool = True
    label: str = ""

    def levels(self) -> list[dict[str, Any]]:
        if self.rate:
            cap = self.concurrency[0] if self.concurrency else None
            return [{"rate": r, "concurrency": cap} for r in self.rate]
        return [{"rate": None, "concurrency": c} for c in self.concurrency or [1]]

    def validate(self) -> None:
        if self.requests is None and self.duration_s is None:
            raise ValueError("give --requests or --duration (or both)")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"--requests must be >= 1, got {self.requests}")
        if any(c < 1 for c in self.concurrency or []):
            raise ValueError(f"--concurrency values must be >= 1, got {self.concurrency}")
        if self.rate and self.concurrency and len(self.concurrency) > 1:
            raise ValueError("with --rate, --concurrency is one value (a cap on requests in flight)")
        if self.rate and any(r <= 0 for r in self.rate):
            raise ValueError(f"--rate values must be > 0, got {self.rate}")
        try:
            check_draft_tokens(self.draft_tokens)  # the rule every generate request is held to
        except BatonError as exc:
            raise ValueError(f"--draft-tokens: {exc.message}") from None
        LengthSpec.parse(self.input_len), LengthSpec.parse(self.max_tokens)


class Progress:
    """A tqdm bar on stderr: requests done, errors, output tok/s over the last 5 s."""

    def __init__(self, enabled: bool, total: int | None, desc: str) -> None:
        self.bar = None
        if enabled:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr, dynamic_ncols=True, leave=True)
        self.errors = 0
        self.window: collections.deque[tuple[float, int]] = collections.deque()

    def tokens(self, now: float, n: int) -> None:
        self.window.append((now, n))

    def done(self, record: RequestRecord) -> None:
        self.errors += record.error is not None
        if self.bar is None:
            return
        now = time.perf_counter()
        while self.window and now - self.window[0][0] > 5.0:
            self.window.popleft()
        span = now - self.window[0][0] if len(self.window) > 1 else 0.0
        tok_s = sum(n for _, n in self.window) / span if span > 0 else 0.0
        self.bar.set_postfix(errors=self.errors, tok_s=f"{tok_s:.1f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def one_request(bus, prompt: Prompt, index: int, t0: float, config: BenchConfig,
                      progress: Progress | None = None) -> RequestRecord:
    """Send one streaming generate; record chunk arrivals (seconds since t0)."""
    seed = None if config.temperature == 0 else config.seed + index
    request = GenerateRequest(prompt=prompt.text, token_ids=prompt.token_ids, max_tokens=prompt.max_tokens,
                              temperature=config.temperature, top_p=config.top_p, seed=seed, stream=True,
                              stop=list(config.stop), draft_tokens=config.draft_tokens)
    record = RequestRecord(index=index, sent=time.perf_counter() - t0, prompt_tokens=prompt.size)
    try:
        async with bus.stream_request(subjects.GENERATE, request, StreamChunk,
                                      timeout_per_message=config.timeout_s) as chunks:
            async for chunk in chunks:
                now = time.perf_counter()
                if chunk.token_ids:
                    record.chunks.append((now - t0, len(chunk.token_ids)))
                    if progress is not None:
                        progress.tokens(now, len(chunk.token_ids))
                if chunk.finished:
                    record.ended = now - t0
                    record.finish_reason = chunk.finish_reason
                    record.prompt_tokens = chunk.usage.prompt_tokens
                    record.completion_tokens = chunk.usage.completion_tokens
                    record.spec = {"verify_steps": chunk.spec.verify_steps, "drafted": chunk.spec.drafted,
                                   "accepted": chunk.spec.accepted}
        if record.ended is None:
            raise BatonError(ErrorCode.INTERNAL, "the stream ended without a finished chunk")
    except BatonError as exc:
        record.error, record.error_message = exc.code.value, exc.message
        record.ended = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - a harness bug must not stop the run; it is counted
        record.error, record.error_message = "client", f"{type(exc).__name__}: {exc}"
        record.ended = time.perf_counter() - t0
    return record


async def run_level(bus, prompts: list[Prompt], config: BenchConfig, *, concurrency: int | None,
                    rate: float | None, desc: str = "") -> tuple[list[RequestRecord], float]:
    """Measure one level; returns the records and the window (first sent -> last ended) in s.
    Prompts are used in order and cycled when --duration runs past them."""
    total = config.requests
    progress = Progress(config.progress, total, desc)
    t0 = time.perf_counter()
    deadline = t0 + config.duration_s if config.duration_s is not None else math.inf
    indices = _indices(total)
    records: list[RequestRecord] = []

    def next_index() -> int | None:
        if time.perf_counter() >= deadline:
            return None
        return next(indices, None)

    async def send(i: int) -> None:
        record = await one_request(bus, prompts[i % len(prompts)], i, t0, config, progress)
        records.append(record)
        progress.done(record)

    try:
        if rate is None:
            async def worker() -> None:
                while (i := next_index()) is not None:
                    await send(i)
            await asyncio.gather(*(worker() for _ in range(concurrency or 1)))
        else:
            rng = random.Random(config.seed + 1)
            cap = asyncio.Semaphore(concurrency) if concurrency else None
            tasks, next_at = [], time.perf_counter()

            async def capped(i: int) -> None:
                async with cap:
                    await send(i)
            while True:
                next_at += rng.expovariate(rate)
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                if (i := next_index()) is None:
                    break
                tasks.append(asyncio.create_task(capped(i) if cap else send(i)))
            await asyncio.gather(*tasks)
    finally:
        progress.close()
    records.sort(key=lambda r: r.index)
    ends = [r.ended for r in records if r.ended is not None]
    return records, (max(ends) - min(r.sent for r in records)) if ends else 0.0


def _indices(total: int | None) -> Iterator[int]:
    i = 0
    while total is None or i < total:
        yield i
        i += 1


async def run_bench(config: BenchConfig, bus=None) -> dict:
    """Run every level of `config` against the deployment at `config.nats_url` (or on `bus`);
    returns the result that `--json` writes: {"config", "machine", "runs": [{level, summary, records}]}."""
    from baton.shared.bus import Bus
    config.validate()
    input_len, max_tokens = LengthSpec.parse(config.input_len), LengthSpec.parse(config.max_tokens)
    n = config.requests or 1024
    prompts = make_prompts(n + config.warmup, input_len, max_tokens, prompts_file=config.prompts_file,
                           model=config.model, seed=config.seed)
    warm, measured = prompts[n:], prompts[:n]
    own_bus = bus is None
    if own_bus:
        from baton.up import client_options  # credentials of a local `baton up`, if that is the target
        bus = await Bus.connect(config.nats_url, "baton-bench", **client_options(config.nats_url))
    runs = []
    try:
        for level in config.levels():
            name = f"rate={level['rate']:g}/s" if level["rate"] else f"c={level['concurrency']}"
            if warm:
                warm_cfg = BenchConfig(**{**asdict(config), "requests": len(warm), "duration_s": None, "progress": False})
                await run_level(bus, warm, warm_cfg, concurrency=min(level["concurrency"] or 1, len(warm)),
                                rate=None)
            records, duration = await run_level(bus, measured, config, desc=f"{config.label} {name}".strip(), **level)
            summary = summarize(records, duration, config.slo_ttft_ms, config.slo_itl_ms)
            runs.append({**level, "name": name, "summary": summary, "records": [r.as_dict() for r in records]})
    finally:
        if own_bus:
            await bus.close()
    cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()}
    return {"tool": "baton bench", "schema": 1, "created_unix": time.time(), "config": cfg,
            "machine": machine_info(), "runs": runs}


def machine_info() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


# --- report ----------------------------------------------------------------------------------

def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def format_report(result: dict) -> str:
    """The tables printed at the end: per level latencies, then a sweep table when >1 level."""
    cfg, lines = result["config"], []
    head = (f"baton bench  {cfg['nats_url']}  input {cfg['input_len']}{' (file)' if cfg['prompts_file'] else ''} "
            f"tokens, max_tokens {cfg['max_tokens']}, "
            + ("greedy" if cfg["temperature"] == 0 else f"temperature {cfg['temperature']:g}")
            + ("" if cfg.get("draft_tokens") is None else f", draft_tokens {cfg['draft_tokens']}")
            + f", warm-up {cfg['warmup']}")
    lines.append(head)
    for run in result["runs"]:
        s = run["summary"]
        lines.append("")
        lines.append(f"[{run['name']}]  {s['requests']} requests, {s['completed']} ok, "
                     f"{sum(s['errors'].values())} errors, {s['duration_s']:.2f} s")
        lines.append(f"  {'':<10}" + "".join(f"{k:>10}" for k in STAT_KEYS))
        for key, label in (("ttft_ms", "TTFT ms"), ("itl_ms", "ITL ms"), ("tpot_ms", "TPOT ms"), ("e2e_ms", "E2E ms")):
            lines.append(f"  {label:<10}" + "".join(f"{_f(s[key][k]):>10}" for k in STAT_KEYS))
        g = s["goodput"]
        slo = ", ".join(x for x in (f"TTFT <= {g['slo_ttft_ms']:g} ms" if g["slo_ttft_ms"] is not None else "",
                                    f"ITL <= {g['slo_itl_ms']:g} ms" if g["slo_itl_ms"] is not None else "") if x)
        lines.append(f"  throughput  {_f(s['requests_per_s'], 2)} req/s, {_f(s['output_tokens_per_s'])} output tok/s "
                     f"({s['output_tokens']} tokens)")
        lines.append(f"  goodput     {g['requests']}/{s['requests']} requests ({_f(100 * g['fraction'], 0)}%), "
                     f"{_f(g['requests_per_s'], 2)} req/s" + (f"  [{slo}]" if slo else "  [no SLO given]"))
        lines.append(f"  acceptance  {_f(s['acceptance_length'], 2)} tokens per verify step "
                     f"({s['spec']['accepted']}/{s['spec']['drafted']} drafts accepted)")
        lines.append("  errors      " + (", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"))
    if len(result["runs"]) > 1:
        lines.append("")
        lines.append(sweep_table({cfg.get("label") or "": result}))
    return "\n".join(lines)


SWEEP_COLUMNS = (("req/s", lambda s: _f(s["requests_per_s"], 2)), ("tok/s", lambda s: _f(s["output_tokens_per_s"])),
                 ("TTFT p50", lambda s: _f(s["ttft_ms"]["p50"])), ("TTFT p99", lambda s: _f(s["ttft_ms"]["p99"])),
                 ("ITL p50", lambda s: _f(s["itl_ms"]["p50"])), ("ITL p99", lambda s: _f(s["itl_ms"]["p99"])),
                 ("TPOT p50", lambda s: _f(s["tpot_ms"]["p50"])), ("E2E p50", lambda s: _f(s["e2e_ms"]["p50"])),
                 ("E2E p99", lambda s: _f(s["e2e_ms"]["p99"])), ("good", lambda s: f"{s['goodput']['requests']}/{s['requests']}"),
                 ("tau", lambda s: _f(s["acceptance_length"], 2)), ("err", lambda s: str(sum(s["errors"].values()))))


def sweep_table(results: dict[str, dict]) -> str:
    """One row per (system, level): the curve. `results` maps a system name to a run_bench result."""
    header = f"{'system':<14}{'level':<14}" + "".join(f"{name:>10}" for name, _ in SWEEP_COLUMNS)
    rows = [header, "-" * len(header)]
    for system, result in results.items():
        for run in result["runs"]:
            rows.append(f"{system:<14}{run['name']:<14}" + "".join(f"{fn(run['summary']):>10}" for _, fn in SWEEP_COLUMNS))
    return "\n".join(rows)


def markdown_table(results: dict[str, dict]) -> str:
    """`sweep_table` as a Markdown table (for docs/benchmarks.md)."""
    cols = ["system", "level"] + [name for name, _ in SWEEP_COLUMNS]
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for system, result in results.items():
        for run in result["runs"]:
            rows.append("| " + " | ".join([system, run["name"]] + [fn(run["summary"]) for _, fn in SWEEP_COLUMNS]) + " |")
    return "\n".join(rows)


def plot(results: dict[str, dict], out_dir: Path) -> list[Path]:
    """Latency CDFs (TTFT, ITL, E2E; one line per system and level) and throughput vs
    concurrency (or rate) as PNGs in `out_dir`. Needs matplotlib (`pip install matplotlib`)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    metrics = (("ttft", "TTFT (ms)"), ("itl", "inter-token latency (ms)"), ("e2e", "end-to-end latency (ms)"))
    for ax, (metric, label) in zip(axes, metrics):
        for system, result in results.items():
            for run in result["runs"]:
                values = sorted(_metric_values(run["records"], metric))
                if values:
                    ys = [(i + 1) / len(values) for i in range(len(values))]
                    ax.step(values, ys, where="post", label=f"{system} {run['name']}".strip())
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    written.append(out_dir / "latency_cdf.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system, result in results.items():
        runs = result["runs"]
        xs = [run["rate"] if run["rate"] else run["concurrency"] for run in runs]
        line, = ax1.plot(xs, [run["summary"]["output_tokens_per_s"] for run in runs], "o-",
                         label=system or "output tok/s")
        ax2.plot(xs, [run["summary"]["itl_ms"]["p50"] for run in runs], "o-", color=line.get_color(),
                 label=f"{system} ITL p50".strip())
        ax2.plot(xs, [run["summary"]["itl_ms"]["p99"] for run in runs], "s--", color=line.get_color(),
                 label=f"{system} ITL p99".strip())
    xlabel = "request rate (req/s)" if any(run["rate"] for r in results.values() for run in r["runs"]) else "concurrency"
    ax1.set_xlabel(xlabel)
    ax1.set_ylabel("output tokens/s")
    ax2.set_xlabel(xlabel)
    ax2.set_ylabel("inter-token latency (ms)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    written.append(out_dir / "throughput.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def _metric_values(records: list[dict], metric: str) -> list[float]:
    out = []
    for r in records:
        if r["error"] is not None or not r["chunks"]:
            continue
        times = [t for t, _ in r["chunks"]]
        if metric == "ttft":
            out.append((times[0] - r["sent"]) * 1000)
        elif metric == "itl":
            out += [(b - a) * 1000 for a, b in zip(times, times[1:])]
        else:
            out.append((r["ended"] - r["sent"]) * 1000)
    return out


# --- command line ----------------------------------------------------------------------------

def _positive_list(cast: type, noun: str, example: str):
    """An argparse type: a comma list of positive `cast` values ("1,2,4")."""
    def parse(text: str) -> list:
        try:
            values = [cast(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun} like {example}, got {text!r}") from None
        if not values or min(values) <= 0:
            raise argparse.ArgumentTypeError(f"expected positive {noun} like {example}, got {text!r}")
        return values
    return parse


_int_list = _positive_list(int, "integers", "1,2,4")
_float_list = _positive_list(float, "numbers", "0.5,1,2")


def _length(text: str) -> str:
    try:
        return str(LengthSpec.parse(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `baton bench`."""
    parser.add_argument("--nats-url", default=None, help="default: $BATON_NATS_URL, `baton up`'s, or localhost:4222")
    g = parser.add_argument_group("load")
    g.add_argument("--requests", type=int, default=None, help="measured requests per level (default 32, "
                   "or unbounded with --duration)")
    g.add_argument("--concurrency", type=_int_list, default=None,
                   help="requests in flight; a list (1,2,4,8) sweeps; with --rate: a cap on requests in flight")
    g.add_argument("--rate", type=_float_list, default=None,
                   help="Poisson arrivals at R requests/s instead of fixed concurrency; a list sweeps")
    g.add_argument("--duration", type=float, default=None, help="stop sending new requests after S seconds per level")
    g.add_argument("--warmup", type=int, default=2, help="requests per level before measuring (not counted)")
    g.add_argument("--timeout", type=float, default=120.0, help="seconds of silence allowed within one request")
    w = parser.add_argument_group("requests")
    w.add_argument("--input-len", type=_length, default="128",
                   help="prompt tokens: N, LOW:HIGH (uniform) or A,B,... (choice); held-out text slices")
    w.add_argument("--max-tokens", "--output-len", dest="max_tokens", type=_length, default="32",
                   help="max_tokens per request: N, LOW:HIGH or A,B,...")
    w.add_argument("--prompts-file", type=Path, default=None,
                   help="prompts, one per line (or .jsonl with {\"prompt\": ...}), sent as text")
    w.add_argument("--model", type=Path, default=None, help="tokenizer for the held-out prompts (default: baton-tiny)")
    w.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    w.add_argument("--top-p", type=float, default=1.0)
    w.add_argument("--draft-tokens", type=int, default=None, dest="request_draft_tokens",
                   help="each request's cap on speculation (0: off; default: the deployment's k)")
    w.add_argument("--seed", type=int, default=0, help="workload seed (prompt choice, arrivals, sampling seeds)")
    w.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    o = parser.add_argument_group("report")
    o.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    o.add_argument("--slo-itl-ms", type=float, default=None, help="goodput: mean inter-token latency (TPOT) at most this")
    o.add_argument("--json", type=Path, default=None, help="write the machine-readable result here")
    o.add_argument("--plot", type=Path, default=None, metavar="DIR",
                   help="write latency_cdf.png and throughput.png here (needs matplotlib)")
    o.add_argument("--label", default="", help="a name for this run in the report and the JSON")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    nats_url = args.nats_url
    if not nats_url:
        from baton.cli import default_nats_url
        nats_url = default_nats_url()
    requests = args.requests if args.requests is not None else (None if args.duration is not None else 32)
    return BenchConfig(
        nats_url=nats_url, requests=requests, concurrency=args.concurrency, rate=args.rate,
        duration_s=args.duration, input_len=args.input_len, max_tokens=args.max_tokens,
        prompts_file=args.prompts_file, model=args.model, warmup=args.warmup, temperature=args.temperature,
        top_p=args.top_p, draft_tokens=args.request_draft_tokens, seed=args.seed, stop=list(args.stop),
        slo_ttft_ms=args.slo_ttft_ms,
        slo_itl_ms=args.slo_itl_ms, timeout_s=args.timeout, progress=not args.no_progress, label=args.label)


def main(args: argparse.Namespace) -> int:
    """`baton bench`: run, print the report, write --json / --plot. Exit status 0 when the run
    completed (errors are reported, not fatal), 1 when nothing could be measured: the
    deployment was unreachable, the options were invalid, or every request failed."""
    try:
        config = config_from_args(args)
        config.validate()
        result = asyncio.run(run_bench(config))
    except (ValueError, OSError) as exc:
        print(f"baton bench: {exc}", file=sys.stderr)
        return 1
    except BatonError as exc:
        print(f"baton bench: {exc} (is a deployment running? set --nats-url or BATON_NATS_URL)", file=sys.stderr)
        return 1
    print(format_report(result))
    if args.json is not None:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot is not None:
        try:
            for path in plot({config.label: result}, args.plot):
                print(f"wrote {path}")
        except ImportError:
            print("baton bench: --plot needs matplotlib (pip install matplotlib); no plots written", file=sys.stderr)
    completed = sum(run["summary"]["completed"] for run in result["runs"])
    return 0 if completed else 1


def write_json(result: dict, path: Path) -> None:
    """Strict JSON (NaN written as null)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(result), indent=1, allow_nan=False) + "\n")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_cli())
