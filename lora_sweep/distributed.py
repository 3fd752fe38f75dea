"""A packed job over d ranks of one host, on torch.distributed.

The script a user writes for one GPU, run under ``torchrun --nproc-per-node d``, spans the d
ranks: `PackedJob` finds the launcher's environment (or a process group the script made
itself) and then

- shards the frozen base with FSDP2 (`fully_shard` on each decoder layer, then the decoder
  body), so each rank holds 1/d of it and all-gathers one layer at a time. The LM head stays
  whole on every rank: the loss reads its weight outside the body's forward. Or, where the
  base takes little of one GPU (`JobSpec.shard_base`, `config.shards_base`), keeps it whole on
  every rank: then a step sends nothing between ranks, needs no lockstep and replays its CUDA
  graphs, and the ranks meet only at step boundaries;
- gives each trial to exactly one rank (its owner, the rank with the fewest trials when it
  joins, ties to the lowest), which alone creates its adapter, trains it on its own rows,
  checkpoints it and saves its PEFT files in the shared `output_dir`. Adapter parameters are
  plain local tensors: their gradients never cross ranks;
- takes membership from rank 0 only: `add_trial` / `remove_trial` on other ranks are ignored
  (every rank runs the same script), and rank 0's queued changes go to every rank at each step
  boundary (one `all_gather_object`, with each rank's trial count) and are applied by every rank
  in the same order, so every rank knows every owner;
- with a sharded base, keeps the ranks in lockstep, since FSDP all-gathers each layer in the
  forward and in the backward: before a phase the ranks agree on its number of forwards, and a
  rank with fewer (or no trials at all) runs the rest on a dummy row (one position, no
  adapters, a loss of zero that still reaches every layer's backward);
- gathers every rank's events to rank 0 at each step boundary: rank 0's `run()` / `step()`
  yields them all, the other ranks yield nothing. Only events travel: adapters and
  checkpoints are written by their owner into the shared `output_dir` (one host). `trials`,
  `trial_state` and `save_adapter` of an active trial are per rank (the owner's);
  `evaluate` is a collective that every rank must call.

A collective that fails (a peer died: gloo raises on the closed connection, or the process
group's timeout passed) stops the job with a `PeerFailure` naming the rank count; starting
the same command again resumes every trial from its checkpoints (`JobSpec.checkpoint_every`).

A base given as a hub id or local directory is built on the meta device and each rank reads
only its shard of every weight from the safetensors files (`materialize`; every weight whole
when the base is not sharded), so a base larger than one GPU or than the host's memory can
start; a base given as a factory is built whole on every rank, then sharded.

`lora-sweep run` starts a job planned on d GPUs this way (`cli._train_on_ranks`), and so does a
`PackedLoRASampler.optimize` script under torchrun; Ray's `PackedExecutor(gpus_per_server=d)`
makes the d ranks of each pack server actors of one placement group that meet through `join`.
A tuner drives rank 0; the other ranks `follow` each run of the job. `rank_group.RankGroupJob`
starts such a job's ranks as processes of its own, for a tuner that keeps several
(`PackedLoRASampler(devices=[[0, 1], [2, 3]])`). The cost model (lora_sweep/costmodel.py)
describes this layout for the planner. Not built yet: tensor parallelism.
Out-of-memory retries are not agreed between ranks: with a sharded base one rank's retry or
eviction breaks the lockstep, and the job stops with a `PeerFailure` (at the latest on the
timeout); with a whole base each rank retries on its own. CUDA graphs are
off in a job with a sharded base.
"""

from __future__ import annotations

import atexit
import datetime
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

TIMEOUT = datetime.timedelta(minutes=10)  # a collective waiting longer than this means a peer is stuck


class PeerFailure(RuntimeError):
    """A collective of a d-rank job failed: a peer rank died or stopped answering."""


def from_collective(error: BaseException) -> bool:
    """Whether `error` came out of a collective: torch.distributed's own errors, or the
    RuntimeError gloo and NCCL raise (FSDP's all-gathers run inside the model's forward)."""
    if isinstance(error, PeerFailure):
        return False
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    return isinstance(error, RuntimeError) and any(word in str(error) for word in ("gloo", "NCCL", "Connection"))


def attach(device: torch.device) -> Optional["Ranks"]:
    """The ranks of this job: a process group already made by the script, or one made here from
    torchrun's environment (gloo on CPU, NCCL on CUDA, with a finite timeout). None on a single
    process (no launcher, or a world of one)."""
    if not dist.is_available():
        return None
    if not dist.is_initialized():
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return None
        if device.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
        # the group made here is taken down here: a process that exits with it still up may
        # abort in its backend's threads ("terminate called without an active exception")
        atexit.register(_destroy_group)
    if dist.get_world_size() == 1:
        return None
    return Ranks()


class Rendezvous:
    """Where the ranks of a group that no launcher started meet (Ray actors, `RankGroupJob`'s
    processes): torch.distributed's key-value store, served by this process on a port the
    operating system gave the store as it opened it, so no other process can take the port
    before the ranks come. It serves as long as this object lives, which must outlast the
    ranks' group (making subgroups goes through it). `address` (``host:port``) is what each
    rank passes to `join`."""

    def __init__(self):
        import socket

        host = socket.gethostbyname(socket.gethostname())
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        self.address = f"{host}:{self.store.port}"


def store_at(address: str) -> "dist.TCPStore":
    """A client of the `Rendezvous` at `address` (``host:port``)."""
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=TIMEOUT)


def join(address: str, rank: int, world_size: int, device: torch.device,
         store: Optional["dist.TCPStore"] = None) -> None:
    """Make this process rank `rank` of a group of `world_size` that meets at the `Rendezvous`
    at `address` (or through `store`, a client of it this process already holds): for ranks
    that no launcher started. `attach` then finds the group."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store or store_at(address),
                            rank=rank, world_size=world_size, timeout=TIMEOUT)
    atexit.register(_destroy_group)


def follow(job) -> None:
    """A rank other than 0 of `job` when rank 0 drives it from a tuner: run the job with rank
    0 each time it starts a run (`Ranks.start_run`), until rank 0 says there is none left
    (`Ranks.end_runs`). Rank 0's events are the job's; this rank's `run()` yields nothing."""
    while job.ranks.all_gather(None)[0] == _CONTINUE:
        for _ in job.run():
            pass


_CONTINUE, _STOP = "continue", "stop"  # rank 0's word to the others before each run of a driven job


def _destroy_group() -> None:
    """Take the group down at exit, after the other ranks reach their exit too (gloo: at most
    30 s): a rank whose peer tears down its connections while this rank's last collective is
    still in flight can abort in gloo's threads."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "gloo":
        try:
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
        except Exception:  # noqa: BLE001 - a peer that died or is stuck: tear down all the same
            pass
    dist.destroy_process_group()


def shard_base(body: nn.Module) -> None:
    """FSDP2 over the frozen decoder: each layer its own unit, then the body (embeddings and
    final norm). Call it after the layers are wrapped and fused, so FSDP manages the modules
    the forward runs; adapters added later stay outside it."""
    from torch.distributed.fsdp import fully_shard

    layers = getattr(body, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(body).__name__} has no `layers` list of decoder layers to shard.")
    for layer in layers:
        fully_shard(layer)
    fully_shard(body)


def materialize(model: nn.Module, checkpoint_dir: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Fill `model`, built on the meta device (`model.load_base_model(on_meta=True)`) and sharded
    (`shard_base`), from the safetensors files of `checkpoint_dir`: each rank allocates its shards
    and reads only its own rows of each sharded weight (FSDP2 gives rank k rows k*c .. (k+1)*c
    of a weight of n rows, c = ceil(n / d)), one tensor at a time, so neither the host nor one
    GPU ever holds the whole base. The LM head (whole on every rank) is read from the input
    embedding where the two are tied. Buffers the checkpoint does not hold (rotary frequencies)
    come from a fresh copy of their module. Returns the LM head's weight."""
    from torch.distributed.tensor import DTensor, Shard

    if not os.path.isdir(checkpoint_dir):  # a hub id: its files, from the local cache where they are
        from huggingface_hub import snapshot_download

        checkpoint_dir = snapshot_download(checkpoint_dir, allow_patterns=["*.safetensors", "*.safetensors.index.json"])
    model.to_empty(device=device)
    files = _checkpoint_files(checkpoint_dir)
    tied = getattr(model.config, "tie_word_embeddings", False)
    head = model.get_output_embeddings().weight
    embedding_key = _checkpoint_key(model, model.get_input_embeddings().weight)
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = name.replace(".base_layer.", ".")
            if key not in files and param is head and tied:
                key = embedding_key
            if key not in files:
                raise ValueError(f"{checkpoint_dir} has no weight {key!r} for the sharded base.")
            rows = files[key].get_slice(key)
            if isinstance(param, DTensor):
                if tuple(param.placements) != (Shard(0),):
                    raise ValueError(f"{name} is sharded as {param.placements}; only FSDP's Shard(0) is read.")
                local = param.to_local()
                n = rows.get_shape()[0]
                start = dist.get_rank() * -(-n // dist.get_world_size())
                if local.shape[0]:
                    local.copy_(rows[start:start + local.shape[0]].to(dtype))
            else:
                param.copy_(rows[:].to(dtype))
        for module_name, module in model.named_modules():
            fresh = None  # the module rebuilt, once, for the buffers the checkpoint lacks
            for name, buffer in list(module.named_buffers(recurse=False)):
                key = f"{module_name}.{name}" if module_name else name
                if key in files:
                    buffer.copy_(files[key].get_tensor(key))
                    continue
                fresh = _fresh_copy(module, key) if fresh is None else fresh
                module.register_buffer(name, getattr(fresh, name).to(device), persistent=False)
    return model.get_output_embeddings().weight


def _checkpoint_files(checkpoint_dir: str) -> dict:
    """Each weight name of a safetensors checkpoint (one file, or shards with an index) and an
    open handle of the file that holds it."""
    import json

    from safetensors import safe_open

    index = os.path.join(checkpoint_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = json.load(f)["weight_map"]
    else:
        names = None
    files = {}
    for file in sorted(set(names.values())) if names else ["model.safetensors"]:
        path = os.path.join(checkpoint_dir, file)
        if not os.path.exists(path):
            raise ValueError(f"{checkpoint_dir} has no safetensors checkpoint ({file}): a sharded base is read "
                             "from safetensors files only.")
        handle = safe_open(path, framework="pt")
        files.update((key, handle) for key in handle.keys())
    return files


def _checkpoint_key(model: nn.Module, param: torch.Tensor) -> str:
    for name, p in model.named_parameters(remove_duplicate=False):
        if p is param:
            return name.replace(".base_layer.", ".")
    raise ValueError("The input embedding's weight is not a parameter of the model.")


def _fresh_copy(module: nn.Module, key: str) -> nn.Module:
    """`module` built again from its config on the host: its buffers computed, not read."""
    config = getattr(module, "config", None)
    if config is None:
        raise ValueError(f"The base's buffer {key!r} is neither in its checkpoint nor computable: a sharded base "
                         "cannot be built on the meta device.")
    return type(module)(config)


class Ranks:
    """This process's place among the job's ranks, and the few collectives the engine uses.
    Python objects and counts go over gloo (a group of their own when the job's is NCCL)."""

    def __init__(self):
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self.owners: dict[str, int] = {}  # trial_id -> the rank that trains it, identical on every rank

    def _collective(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - whatever the backend raises for a dead or stuck peer
            raise self.failure(e) from e

    def failure(self, error: BaseException) -> PeerFailure:
        return PeerFailure(
            f"The packed job on {self.size} ranks stopped: a collective failed on rank {self.rank} "
            f"({type(error).__name__}: {error}). Another rank probably died or stopped answering. Start the "
            "job again (the same command) to resume its trials from their checkpoints (checkpoint_every).")

    def all_gather(self, value) -> list:
        """Every rank's `value`, in rank order, on every rank."""
        out = [None] * self.size
        self._collective(dist.all_gather_object, out, value, self.group)
        return out

    def start_run(self) -> None:
        """Rank 0, before each `run()` of a job it drives: the ranks in `follow` run it too."""
        self.all_gather(_CONTINUE)

    def end_runs(self) -> None:
        """Rank 0, when it will start no more runs: `follow` returns on the other ranks."""
        self.all_gather(_STOP)

    def max(self, value: int) -> int:
        """The largest of every rank's `value`."""
        t = torch.tensor([value], dtype=torch.long)
        self._collective(dist.all_reduce, t, dist.ReduceOp.MAX, self.group)
        return int(t.item())

    def route(self, ops: list, loads: list[int]) -> list:
        """The membership changes (rank 0's, the same list on every rank) this rank applies, in
        order. A trial goes to its earlier owner if it had one (so that a second trial of a
        running id is rejected where the first runs), else to the rank with the fewest trials
        (`loads`, every rank's count before these changes); a removal goes to every rank."""
        loads = list(loads)
        mine = []
        for op in ops:
            kind, item, _ = op
            if kind == "remove":
                mine.append(op)
                continue
            tid = item.trial_id if hasattr(item, "trial_id") else item.get("trial_id") if isinstance(item, dict) \
                else None
            owner = self.owners.get(str(tid)) if tid is not None else None
            if owner is None:
                owner = min(range(self.size), key=lambda r: (loads[r], r))
                loads[owner] += 1
                if tid is not None:
                    self.owners[str(tid)] = owner
            if owner == self.rank:
                mine.append(op)
        return mine

    def dummy_pass(self, job, backward: bool) -> None:
        """One forward (and backward) of the base on a single position without adapters, so
        that this rank takes part in the all-gathers of a forward it has no rows for. Its input
        requires grad, so the backward runs through every layer; its loss is zero."""
        hidden = job.model.config.hidden_size
        x = torch.zeros(1, 1, hidden, device=job.device, dtype=job.dtype, requires_grad=backward)
        job.segments.clear()
        with torch.enable_grad() if backward else torch.no_grad():
            out = job.body(inputs_embeds=x, use_cache=False).last_hidden_state
            if backward:
                torch.autograd.grad(out.float().sum() * 0.0, x)
