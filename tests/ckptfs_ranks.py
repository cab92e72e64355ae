"""Forked torch.distributed ranks for the fixture generators (tests/zero, tests/dcp): one
process group per world size, each rank running every case of that size in turn. Importable
without torch; the generators import it after putting tests/ on sys.path."""

import os
import socket
import time


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the rendezvous of one group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, rank_main, world_size: int, port: int, names: list, out: str) -> None:
    # The env:// rendezvous torch.distributed (and DeepSpeed) read.
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_SIZE=str(world_size),
    )
    rank_main(rank, world_size, names, out)


def run_ranks_per_world_size(rank_main, names_by_world_size: dict, out) -> None:
    """For each world size, in increasing order, fork that many processes running
    RANK_MAIN(rank, world_size, names, str(OUT)) with the rendezvous in the environment, and
    wait for all of them (an exception in one rank raises here). Forked, not spawned: the
    parent's imports are inherited, so the ranks start warm."""
    import torch.multiprocessing as mp

    for world_size in sorted(names_by_world_size):
        names = names_by_world_size[world_size]
        started = time.monotonic()
        mp.start_processes(
            _rank_entry,
            args=(rank_main, world_size, free_port(), names, str(out)),
            nprocs=world_size,
            start_method="fork",
            join=True,
        )
        print(f"world size {world_size}: {len(names)} checkpoints in {time.monotonic() - started:.1f}s", flush=True)
