"""A packed job over a group of devices, driven from this process.

A job over d devices needs d processes (FSDP2 runs one rank per device), so a tuner that keeps
several such jobs at once (`PackedLoRASampler(devices=[[0, 1], [2, 3]])`) cannot hold them
itself. `RankGroupJob` starts the d ranks of one job as processes of their own (`python -m
lora_sweep.rank_group`: fresh interpreters, so the caller's script is not imported again),
which meet through torch.distributed (`distributed.join`: NCCL on GPUs, gloo on CPUs) as
under torchrun: rank 0 holds the `PackedJob`, the others `follow` it. This process talks to
rank 0 through a local authenticated connection and sees a job with the calls a tuner
makes: `add_trial`, `remove_trial`, `run()` (one event per call through the connection),
`saved_state`, `release_locks`, `trials`, `waiting`, `spec`, `module_shapes`, `pack_id`.

The base must be a name or a directory (each rank reads its shard of it), since the spec
travels to the ranks by pickling. What a rank raises comes back and is raised here; a rank
that dies stops the job with `distributed.PeerFailure`, as in any d-rank job.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile
import time
import weakref
from multiprocessing.connection import Client, Listener
from typing import Any, Iterator, Optional, Sequence

import torch

from .config import JobSpec

START_TIMEOUT_S = 1800.0  # loading a large base shard by shard takes minutes
_AUTHKEY_ENV = "LORA_SWEEP_GROUP_AUTHKEY"  # the pipe's key, passed to the ranks outside their command line
_PIPE_PORT_KEY = "lora_sweep/pipe_port"  # rank 0's port for the pipe, in the rendezvous' store


class RankGroupJob:
    """One packed job of `spec` over `devices` (one rank per device, rank 0 on the first), in
    processes started here.

    Example:

        .. code::

            job = RankGroupJob(spec, ["cuda:0", "cuda:1"])
            job.add_trial(TrialConfig(rank=16, max_steps=100))
            for event in job.run():
                print(event)
            job.close()
    """

    def __init__(self, spec: JobSpec, devices: Sequence[str], *, start_timeout_s: float = START_TIMEOUT_S):
        if not isinstance(spec.base_model, str):
            raise ValueError("A job over a device group needs `base_model` as a hub id or a local directory (each "
                             "rank reads its own shard), not a factory.")
        if len(devices) < 2:
            raise ValueError(f"The value of `devices` is {list(devices)!r}, but a device group has at least 2.")
        from .distributed import Rendezvous

        self.devices = [str(d) for d in devices]
        self.spec = dataclasses.replace(spec, device=self.devices[0])
        self.device = torch.device(self.devices[0])  # rank 0's
        self.memory_model = None  # set by the tuner that admits trials into it
        self.progress = False
        self.ranks = None  # the ranks are driven from rank 0's own process, not from here
        # the ranks are fresh interpreters (`python -m lora_sweep.rank_group`), so the caller's
        # script is never imported again in them; the spec reaches them in a file
        self._spec_file = tempfile.NamedTemporaryFile(prefix="lora_sweep_group_", suffix=".pkl", delete=False)
        with self._spec_file as f:
            pickle.dump(spec, f)
        authkey = os.urandom(16)
        rendezvous = Rendezvous()  # where the ranks meet, and where rank 0 says on which port it listens
        self._processes = [subprocess.Popen(
            [sys.executable, "-m", "lora_sweep.rank_group", self._spec_file.name, ",".join(self.devices), str(rank),
             rendezvous.address], env={**os.environ, _AUTHKEY_ENV: authkey.hex()})
            for rank in range(len(self.devices))]
        self._pipe: list = []  # the connection to rank 0, once made (a list: the finalizer holds it, not self)
        # the finalizer holds the rendezvous too: it serves until the ranks have exited
        self._finalizer = weakref.finalize(self, _shut_down, self._pipe, self._processes, self._spec_file.name,
                                           rendezvous)
        self._pipe.append(self._connect(rendezvous.store, authkey, start_timeout_s))
        self._conn = self._pipe[0]
        ready = self._receive(start_timeout_s, "to load the base")
        self.pack_id, self.module_shapes = ready["pack_id"], ready["module_shapes"]

    def _connect(self, store, authkey: bytes, timeout_s: float):
        """The pipe to rank 0, once it listens (on the port it writes to `store`)."""
        from .distributed import PeerFailure

        deadline = time.monotonic() + timeout_s
        while not store.check([_PIPE_PORT_KEY]):
            dead = self._dead()
            if dead or time.monotonic() > deadline:
                self._finalizer()
                raise PeerFailure(f"The job on {self.devices} did not start: "
                                  f"{', '.join(dead) or 'rank 0 did not listen'}.")
            time.sleep(0.2)
        return Client(("127.0.0.1", int(store.get(_PIPE_PORT_KEY))), authkey=authkey)

    def _dead(self) -> list[str]:
        return [f"rank {r} exited with {p.returncode}" for r, p in enumerate(self._processes) if p.poll() is not None]

    # ---- the job's calls, on rank 0

    def add_trial(self, cfg, state: Optional[dict] = None) -> Optional[str]:
        return self._call("add_trial", cfg, state)

    def remove_trial(self, trial_id: str) -> None:
        self._call("remove_trial", trial_id)

    def saved_state(self, trial_id: str) -> Optional[dict]:
        return self._call("saved_state", trial_id)

    def release_locks(self) -> None:
        self._call("release_locks")

    @property
    def trials(self) -> dict:
        """Rank 0's active trials (as `PackedJob.trials` on rank 0 of a d-rank job)."""
        return self._call("trials")

    @property
    def waiting(self) -> list:
        return self._call("waiting")

    def run(self) -> Iterator[Any]:
        """`PackedJob.run` on every rank: rank 0's events, one per call through the pipe."""
        self._call("start_run")
        while (event := self._call("next")) is not None:
            yield event

    def close(self) -> None:
        """End the ranks: rank 0 tells the others there is no further run, and all exit."""
        self._finalizer()

    # ---- the pipe

    def _call(self, op: str, *args) -> Any:
        if not self._finalizer.alive:
            raise RuntimeError(f"The job on {self.devices} is closed.")
        self._conn.send((op, args))
        return self._receive(None, f"to answer {op!r}")

    def _receive(self, timeout_s: Optional[float], doing: str) -> Any:
        """Rank 0's answer; its error raised here; a PeerFailure if rank 0 exits without one."""
        from .distributed import PeerFailure

        waited = 0.0
        while not self._conn.poll(1.0):
            waited += 1.0
            dead = self._dead()
            if dead or (timeout_s is not None and waited > timeout_s):
                self._finalizer()
                raise PeerFailure(f"The job on {self.devices} stopped: "
                                  f"{', '.join(dead) if dead else f'rank 0 took over {timeout_s:.0f} s'} {doing}.")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._finalizer()
            raise PeerFailure(f"The job on {self.devices} stopped: rank 0 closed its pipe {doing}.") from None
        if kind == "error":
            raise value
        return value


def _shut_down(pipe: list, processes, spec_file: str, rendezvous) -> None:
    """Stop rank 0 (which tells the others), wait for every rank, then close the pipe and
    remove the spec file; `rendezvous` stops serving when this returns and lets it go."""
    conn = pipe[0] if pipe else None
    try:
        if conn is not None and processes[0].poll() is None:
            conn.send(("stop", ()))
    except (OSError, ValueError):
        pass
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
    if conn is not None:
        conn.close()
    os.unlink(spec_file)


def _rank_main(spec_file: str, devices: list[str], rank: int, group_address: str) -> None:
    """One rank's process: join the group and build the job; rank 0 serves the pipe to the
    driving process, the others follow rank 0's runs."""
    from .distributed import follow, join, store_at
    from .engine import PackedJob

    with open(spec_file, "rb") as f:
        spec = pickle.load(f)
    conn, store = None, store_at(group_address)
    if rank == 0:  # on a port the system picks, written to the rendezvous for the driving process
        with Listener(("127.0.0.1", 0), authkey=bytes.fromhex(os.environ[_AUTHKEY_ENV])) as listener:
            store.set(_PIPE_PORT_KEY, str(listener.address[1]))
            conn = listener.accept()
    device = torch.device(devices[rank])
    join(group_address, rank, len(devices), device, store=store)
    try:
        job = PackedJob(dataclasses.replace(spec, device=str(device)), progress=False)
    except BaseException as err:
        if conn is not None:
            conn.send(("error", _portable(err)))
        raise
    if rank != 0:
        follow(job)
        return
    conn.send(("ok", {"pack_id": job.pack_id, "module_shapes": job.module_shapes}))
    events = None  # the run in progress, if any
    while True:
        try:
            op, args = conn.recv()
        except EOFError:  # the driving process is gone
            op, args = "stop", ()
        try:
            if op == "stop":
                # between runs the others are told; in the middle of one they are inside its
                # collectives, which fail when this process exits
                if events is None:
                    job.ranks.end_runs()
                return
            if op == "start_run":
                job.ranks.start_run()
                events, result = job.run(), None
            elif op == "next":
                result = next(events, None)
                if result is None:
                    events = None
            elif op in ("trials", "waiting"):
                result = dict(job.trials) if op == "trials" else list(job.waiting)
            else:  # add_trial, remove_trial, saved_state, release_locks
                result = getattr(job, op)(*args)
        except BaseException as err:  # noqa: BLE001 - raised in the driving process
            conn.send(("error", _portable(err)))
        else:
            conn.send(("ok", result))


def _portable(err: BaseException) -> BaseException:
    """`err` if it survives pickling, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(err).__name__}: {err}")


if __name__ == "__main__":
    _spec_file, _devices, _rank, _group_address = sys.argv[1:5]
    _rank_main(_spec_file, _devices.split(","), int(_rank), _group_address)
