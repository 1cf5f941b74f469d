"""Tensor parallelism: one model over N ranks, each holding 1/N of the weights and of the KV.

The split is Megatron's, as nano-vllm lays it out:

- q, k, v projections and the MLP's gate and up projections are column-parallel: each rank
  computes its own heads (its own share of the intermediate features), nothing is exchanged;
- the output projection and the MLP's down projection are row-parallel: each rank's product
  is a partial sum of the full one, and one all-reduce per projection adds them;
- the embedding and the LM head are split by vocabulary: a token's embedding comes from the
  rank holding its row (an all-reduce of the masked lookups), and rank 0 gathers the logits'
  column blocks.

A rank is a Hugging Face model built from a shard config (heads, KV heads, intermediate size
and vocabulary divided by N, head_dim kept), so FlatModel runs it unchanged apart from the
three exchanges above. Each rank reads only its own slices of the safetensors files.

`Shards` is a rank's place in the group and its exchanges: gloo on the CPU, NCCL on CUDA.
Rank 0 sends each step (batch.Step) to the others, which follow it (verifier/ranks.py).
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# How long the other ranks wait for rank 0's next step: as long as the verifier is idle. A
# rank 0 that dies is seen at once all the same (its connections close; the ranks die with it).
CONTROL_TIMEOUT = datetime.timedelta(days=365)

# Which weights split how: by output rows (column-parallel, vocabulary), by input columns
# (row-parallel). Everything else (norms) is replicated.
ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
COLUMNS = ("o_proj", "down_proj")


class ShardError(ValueError):
    """The model cannot be split over this many ranks; the message names the key and numbers."""


class ShardsLost(RuntimeError):
    """A rank of the group failed or left: the group cannot compute another step."""


def shard_config(config, world: int, *, key: str = "verifier.tensor_parallel"):
    """The config of one rank's shard of a model with `config`: heads, KV heads, intermediate
    size and vocabulary divided by `world` (head_dim kept). Raises ShardError when one of them
    does not divide."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    sizes = {
        "attention heads": config.num_attention_heads,
        "KV heads": config.num_key_value_heads,
        "intermediate size": config.intermediate_size,
        "vocabulary": config.vocab_size,
    }
    for what, size in sizes.items():
        if size % world:
            raise ShardError(
                f"{key}: {world} does not divide the model's {what} ({size}); "
                f"use a divisor of {divisors(sizes.values())}"
            )
    shard = copy.deepcopy(config)
    shard.head_dim = head_dim
    shard.num_attention_heads = config.num_attention_heads // world
    shard.num_key_value_heads = config.num_key_value_heads // world
    shard.intermediate_size = config.intermediate_size // world
    shard.vocab_size = config.vocab_size // world
    shard.pad_token_id = None  # (an embedding's padding row; it may be past this shard's rows)
    return shard


def rank_devices(device: str, world: int, visible: int) -> list[str]:
    """The device of each rank: consecutive CUDA devices from rank 0's, or the CPU for all.
    Raises ValueError naming the key when there are not enough visible devices."""
    if device == "cpu":
        return ["cpu"] * world
    first = int(device.partition(":")[2] or 0)
    if first + world > visible:
        raise ValueError(
            f"verifier.tensor_parallel: {world} ranks from {device} need cuda:{first}.."
            f"cuda:{first + world - 1}, and {visible} CUDA device(s) are visible"
        )
    return [f"cuda:{first + r}" for r in range(world)]


def divisors(sizes) -> str:
    """The rank counts that divide every one of `sizes` (up to 64), as text."""
    ok = [n for n in range(1, 65) if all(s % n == 0 for s in sizes)]
    return ", ".join(map(str, ok))


def split_of(name: str) -> int | None:
    """The dimension a weight named `name` is split along: 0 (rows), 1 (columns) or None."""
    module = module_of(name)
    if module in ROWS:
        return 0
    if module in COLUMNS and name.endswith(".weight"):
        return 1
    return None


def module_of(name: str) -> str:
    """The module a weight belongs to: `o_proj` of `model.layers.0.self_attn.o_proj.weight`."""
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else ""


def load_shard(path: Path, rank: int, world: int, dtype: torch.dtype, device: str):
    """Rank `rank`'s shard of the model in directory `path` (a Hugging Face causal LM saved as
    safetensors), in eval mode on `device`; only its slices are read. A row-parallel bias is
    kept by rank 0 alone (it is added once)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    shard = shard_config(config, world)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shard, dtype=dtype)
    state = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith("rotary_emb.inv_freq"):  # (computed, not loaded)
                    continue
                state[name] = read_slice(f.get_slice(name), name, rank, world).to(dtype)
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ShardError(f"{path}: weights missing {missing[:4]}, unexpected {unexpected[:4]}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    body = model.model
    body.rotary_emb = type(body.rotary_emb)(config=shard)  # (its buffers were on meta)
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ShardError(f"{path}: no weights for {meta[:4]}")
    model.generation_config = _generation_config(path, model.generation_config)
    return model.to(device).eval()


def read_slice(tensor_slice, name: str, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s part of one stored tensor."""
    dim = split_of(name)
    if dim is None:
        if rank and module_of(name) in COLUMNS:  # a row-parallel bias: added once
            return torch.zeros(tensor_slice.get_shape())
        return tensor_slice[:]
    shape = tensor_slice.get_shape()
    size = shape[dim] // world
    lo, hi = rank * size, (rank + 1) * size
    return tensor_slice[lo:hi] if dim == 0 else tensor_slice[:, lo:hi]


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ShardError(f"{path}: no safetensors weights to shard")
    return files


def _generation_config(path: Path, default):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(str(path))
    except OSError:
        return default


@dataclass
class Shards:
    """This process's rank in a tensor-parallel group of `world`, and the exchanges FlatModel
    makes; `lost` says why the group broke, once it did."""

    rank: int
    world: int
    device: torch.device
    vocab_start: int = 0  # the first vocabulary row this rank holds
    lost: str | None = None
    control: object = None  # the gloo group rank 0's steps go over (no idle limit)

    @classmethod
    def join(
        cls, store: dist.Store, rank: int, world: int, device: str, timeout_s: float
    ) -> Shards:
        """Joins the group whose members meet at `store` (NCCL on CUDA, else gloo). Every
        exchange within a step fails after `timeout_s` rather than wait for a rank that
        hangs; the steps themselves come over a gloo group that waits as long as it takes."""
        device = torch.device(device)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        return cls(rank, world, device, control=control)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def embed(self, embedding: torch.nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, hidden]: each rank looks up the ids in its vocabulary rows (the
        rest are zeros) and the all-reduce adds them."""
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < embedding.num_embeddings)
        hidden = embedding(local.clamp(0, embedding.num_embeddings - 1))
        return self.reduce(hidden * inside[:, None].to(hidden.dtype))

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's `x` (a row-parallel product), in place."""
        dist.all_reduce(x)
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """[R, vocab / N] on every rank -> [R, vocab] on rank 0 (None elsewhere)."""
        logits = logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(self.world)] if self.leader else None
        dist.gather(logits, parts, dst=0)
        return torch.cat(parts, dim=1) if self.leader else None

    def send(self, message) -> None:
        """Rank 0: the next thing every rank does (a batch.Step, a PoolShape, None to stop)."""
        self._broadcast(message)

    def receive(self):
        """The other ranks: what rank 0 sent next."""
        return self._broadcast(None)

    def _broadcast(self, message):
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def close(self) -> None:
        """Leaves the group; a lost one is left as it is (tearing it down can wait on the
        rank that is gone), for the process to exit."""
        if dist.is_initialized() and self.lost is None:
            dist.destroy_process_group()
