"""A script that takes names from a lazily importing package inside a function, as
model-building helpers do (``from transformers import BertConfig`` in ``build_model()``), on
every rank at once: the ranks meet at a barrier first, so they import together. See
tests/scripts/lazypkg, which fails when two threads resolve one of its names at once."""

import torch.distributed as dist


def build() -> str:
    import lazypkg
    from lazypkg import Model

    return f"{Model.__name__} {lazypkg.Config.__name__}"


dist.init_process_group("gloo")
dist.barrier()
print(f"rank {dist.get_rank()}: {build()}")
dist.destroy_process_group()
