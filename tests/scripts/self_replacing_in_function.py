"""A helper that imports from a package which replaces itself in ``sys.modules`` (as
transformers does), inside a function: rank 0 begins the import, and every other rank reaches
the same import statement while rank 0 still runs it. See tests/scripts/replacingpkg."""

import importrace
import torch.distributed as dist


def build() -> str:
    from replacingpkg import Config

    return Config.__name__


dist.init_process_group("gloo")
importrace.others = dist.get_world_size() - 1
dist.barrier()
if dist.get_rank() != 0:
    importrace.started.wait(10.0)
print(f"rank {dist.get_rank()}: {build()}")
dist.destroy_process_group()
