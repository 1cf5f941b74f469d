"""`specserve generate`: stream one completion from a gateway to the terminal."""

from __future__ import annotations

import argparse
import sys

import grpc

from ..v1 import common_pb2, generation_pb2, generation_pb2_grpc


def build_request(args: argparse.Namespace) -> generation_pb2.GenerateRequest:
    sampling = common_pb2.SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )
    if args.seed is not None:
        sampling.seed = args.seed
    req = generation_pb2.GenerateRequest(
        max_tokens=args.max_tokens,
        sampling=sampling,
        stop=args.stop,
        priority=common_pb2.PRIORITY_CLASS_BATCH
        if args.batch
        else common_pb2.PRIORITY_CLASS_INTERACTIVE,
    )
    if args.raw:
        req.prompt = args.prompt
    else:
        req.messages.messages.add(role="user", content=args.prompt)
    return req


def generate_to_terminal(args: argparse.Namespace) -> int:
    if args.api_key and not args.ca and not args.insecure:
        print(
            "error: an API key is never sent in plaintext: pass --ca with the gateway's CA "
            "(or set SPECSERVE_CA), or --insecure for a development cluster without TLS",
            file=sys.stderr,
        )
        return 2
    if args.ca:
        with open(args.ca, "rb") as f:
            channel = grpc.secure_channel(args.address, grpc.ssl_channel_credentials(f.read()))
    else:
        channel = grpc.insecure_channel(args.address)
    with channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        try:
            metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else []
            for chunk in stub.Generate(
                build_request(args), timeout=args.timeout, metadata=metadata
            ):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.HasField("final"):
                    f = chunk.final
                    tokens = f.usage.completion_tokens
                    rate = tokens / (f.timings.decode_ms / 1000) if f.timings.decode_ms else 0.0
                    spec = f.speculation
                    print(
                        f"\n\n[{common_pb2.FinishReason.Name(f.finish_reason)}; "
                        f"{f.usage.prompt_tokens} prompt + {tokens} completion tokens; "
                        f"TTFT {f.timings.ttft_ms:.0f} ms; {rate:.2f} tokens/s; "
                        f"{spec.steps} steps, {spec.mean_accepted_length:.2f} tokens/step, "
                        f"{spec.accepted_tokens}/{spec.drafted_tokens} drafts accepted"
                        + (f", {spec.fallback_steps} fallback steps" if spec.fallback_steps else "")
                        + "]",
                        file=sys.stderr,
                    )
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0
