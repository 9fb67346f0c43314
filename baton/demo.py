"""`baton demo`: start the whole system (like `baton up`), send a few requests, print, stop."""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time

from baton.proto import subjects
from baton.proto.public import GenerateReply, GenerateRequest, StreamChunk
from baton.shared.bus import Bus
from baton.up import engine_cpus, start_cluster, wait_ready

PROMPTS = ["To be, or not to be, that is the question:", "ROMEO.\nBut soft, what light through yonder window breaks?"]


async def _requests(url: str, options: dict) -> None:
    bus = await Bus.connect(url, "baton-demo", **options)
    try:
        for prompt in PROMPTS:
            reply = await bus.request(subjects.GENERATE, GenerateRequest(prompt=prompt, max_tokens=48), GenerateReply,
                                      timeout=120)
            print(f"\n>>> {prompt}\n{reply.text}")
            print(f"[greedy; {reply.usage.completion_tokens} tokens in {reply.timing.total_ms:.0f} ms, "
                  f"ttft {reply.timing.ttft_ms:.0f} ms; {reply.spec.accepted}/{reply.spec.drafted} drafts accepted "
                  f"over {reply.spec.verify_steps} verify steps]")
        print(f"\n>>> (streaming, temperature 0.8) {PROMPTS[0]}")
        request = GenerateRequest(prompt=PROMPTS[0], max_tokens=48, temperature=0.8, seed=7, stream=True)
        async with bus.stream_request(subjects.GENERATE, request, StreamChunk, timeout_per_message=120) as chunks:
            async for chunk in chunks:
                print(chunk.text, end="", flush=True)
        print()
    finally:
        await bus.close()


def demo(args) -> int:
    t0 = time.monotonic()
    ns = argparse.Namespace(model=args.model, prefill=1, decode=1, log_dir=tempfile.mkdtemp(prefix="baton-demo-"))
    worker_args = ["--threads", "1"]
    cluster = start_cluster(ns, worker_args, auth=True, cpus=engine_cpus(1, 1, 1))  # as `baton up` places them
    try:
        asyncio.run(wait_ready(cluster.nats_url, cluster, 1, 1, 180.0))
        print(f"baton ready: {cluster.nats_url} (started in {time.monotonic() - t0:.1f} s; logs in {ns.log_dir})")
        asyncio.run(_requests(cluster.nats_url, cluster.client.connect_options()))  # as a client may
        return 0
    except Exception as exc:  # noqa: BLE001 - a demo prints what went wrong and where the logs are
        print(f"baton demo failed: {type(exc).__name__}: {exc}; logs in {ns.log_dir}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
