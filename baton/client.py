"""`baton generate`: one request over the public NATS API, printed."""
from __future__ import annotations

import json
import sys

import msgspec

from baton.proto import subjects
from baton.proto.errors import BatonError
from baton.proto.public import GenerateReply, GenerateRequest, StreamChunk
from baton.shared.bus import Bus
from baton.up import client_options


def build_request(args) -> GenerateRequest:
    return GenerateRequest(prompt=args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                           top_p=args.top_p, seed=args.seed, draft_tokens=args.request_draft_tokens,
                           stream=args.stream)


async def generate(args, url: str) -> int:
    request = build_request(args)
    try:
        bus = await Bus.connect(url, "baton-cli", **client_options(url))
    except BatonError as exc:
        print(f"baton: {exc} (is `baton up` running? set --nats-url or BATON_NATS_URL)", file=sys.stderr)
        return 1
    try:
        if args.stream:
            async with bus.stream_request(subjects.GENERATE, request, StreamChunk, timeout_per_message=args.timeout) as chunks:
                async for chunk in chunks:
                    if args.json:
                        print(json.dumps(msgspec.to_builtins(chunk)), flush=True)
                    else:
                        print(chunk.text, end="", flush=True)
                        if chunk.finished:
                            print(f"\n[{chunk.finish_reason}; {chunk.usage.completion_tokens} tokens; "
                                  f"ttft {chunk.timing.ttft_ms:.0f} ms; total {chunk.timing.total_ms:.0f} ms; "
                                  f"accepted {chunk.spec.accepted}/{chunk.spec.drafted} drafts]", file=sys.stderr)
        else:
            reply = await bus.request(subjects.GENERATE, request, GenerateReply, timeout=args.timeout)
            if args.json:
                print(json.dumps(msgspec.to_builtins(reply)))
            else:
                print(reply.text)
                print(f"[{reply.finish_reason}; {reply.usage.completion_tokens} tokens; "
                      f"ttft {reply.timing.ttft_ms:.0f} ms; total {reply.timing.total_ms:.0f} ms; "
                      f"accepted {reply.spec.accepted}/{reply.spec.drafted} drafts]", file=sys.stderr)
        return 0
    except BatonError as exc:
        print(f"baton: error {exc.code.value}: {exc.message}", file=sys.stderr)
        return 1
    finally:
        await bus.close()
