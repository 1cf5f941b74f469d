"""Stand-ins for the benchmarks' models where their weights are not on this machine: a catalog
directory holding config and tokenizer but no weights (as benchmarks/gpu_bundle.py packs it)
becomes a model directory of the same shape with random weights, in bfloat16. A forward pass
costs what it costs over the real weights, so speeds measured with them hold; what drafts get
accepted does not (random models agree with each other by chance alone).

    python -m benchmarks.gpu_standins --out DIR [--device cuda]

Writes DIR/<role> for each role (target, draft, tiny) that needs one, and DIR/models.json:
the directory each benchmark should use per role, null where the catalog model is here
(use it) or where neither weights nor a config are ("missing" lists those roles: the
benchmark leaves them out).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specserve.common.settings import DrafterSettings, ModelRef, ServiceSettings
from specserve.engine import models

from .engine import TINY

ROLES = {"target": ModelRef(), "draft": DrafterSettings().draft_model, "tiny": TINY}
KEEP = ("config.json", "generation_config.json", "chat_template.jinja", "tokenizer")


def make(source: Path, out: Path, device: str) -> dict:
    """A random-weight copy of the model in `source` at `out`; returns what was made."""
    started = time.monotonic()
    config = AutoConfig.from_pretrained(source)
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it is fast; saved from there
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    shutil.rmtree(out, ignore_errors=True)
    model.save_pretrained(out)
    for file in source.iterdir():
        if file.name.startswith(KEEP):
            shutil.copy2(file, out / file.name)  # the real tokenizer and generation settings
    params = sum(p.numel() for p in model.parameters())
    (out / "STAND-IN.json").write_text(
        json.dumps({"shape_of": str(source), "weights": "random, bfloat16", "params": params})
    )
    seconds = round(time.monotonic() - started, 1)
    return {"from": str(source), "to": str(out), "params": params, "seconds": seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    cache = ServiceSettings.load(None).model_cache_dir
    args.out.mkdir(parents=True, exist_ok=True)
    use: dict[str, str | None] = {}
    missing = []
    for role, ref in ROLES.items():
        use[role] = None
        try:
            path, _ = models.resolve(ref, cache)
        except models.ModelError:
            missing.append(role)
            continue
        if not any(path.glob("*.safetensors")):
            made = make(path, args.out / role, args.device)
            print(json.dumps({"role": role} | made), flush=True)
            use[role] = made["to"]
    (args.out / "models.json").write_text(json.dumps(use | {"missing": missing}, indent=2))
    print(json.dumps(use | {"missing": missing}), flush=True)


if __name__ == "__main__":
    main()
