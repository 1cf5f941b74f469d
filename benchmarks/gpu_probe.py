"""The environment `make gpu-check` runs in, as one JSON line: versions, the device, whether
the services import, and the settings' verdict on the device.

    python -m benchmarks.gpu_probe --device cuda
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys


def describe(device: str) -> dict:
    import google.protobuf
    import grpc
    import pydantic
    import torch
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "grpcio": grpc.__version__,
        "protobuf": google.protobuf.__version__,
        "pydantic": pydantic.VERSION,
        "cpus": os.cpu_count(),
        "cuda_available": torch.cuda.is_available(),
        "redis_server": subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True
        ).stdout.strip(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {
            "gpus": torch.cuda.device_count(),
            "gpu": props.name,
            "gpu_memory_gb": round(props.total_memory / 1e9, 1),
            "capability": f"{props.major}.{props.minor}",
        }
    return info


def matmul_finite(device: str) -> bool:
    import torch

    x = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)  # [1024, 1024]
    return bool(torch.isfinite((x @ x).float().sum()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    import specserve.drafter.server  # noqa: F401  the services import here
    import specserve.gateway.server  # noqa: F401
    import specserve.verifier.server  # noqa: F401
    from specserve.common.settings import ConfigError, VerifierSettings

    info = describe(args.device)
    print("environment:", json.dumps(info, indent=1), flush=True)
    try:
        VerifierSettings.load(None, device=args.device)  # refuses a device that cannot run
    except ConfigError as e:
        print("GPU_CHECK_JSON " + json.dumps(info | {"device_refused": str(e)}))
        sys.exit(f"the settings refuse --device {args.device}: {e}")
    info["matmul_finite"] = matmul_finite(args.device)
    print("GPU_CHECK_JSON " + json.dumps(info))


if __name__ == "__main__":
    main()
