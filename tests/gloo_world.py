"""How the multi-process tests' ranks form their gloo world.

The ranks meet through a file of the launch's own (``new_rendezvous``), never a TCP port: a port
found free and handed to the ranks can be taken before rank 0 binds it, by a world of one that a
test in another pytest-xdist worker builds; rank 1 then joins that stranger's store and waits
until the launch's timeout, with nothing in its log. A collective that waits longer than
``TIMEOUT`` raises in the rank (its traceback reaches the test) instead of hanging it.
"""
import os
import uuid
from datetime import timedelta

import torch.distributed as dist

TIMEOUT = timedelta(seconds=240)


def new_rendezvous(folder) -> str:
    """A file path no other launch uses (a FileStore's file must not outlive one world)."""
    return os.path.join(os.path.abspath(folder), f"rendezvous-{uuid.uuid4().hex}")


def join_world(rank: int, world: int, rendezvous: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world, timeout=TIMEOUT)
