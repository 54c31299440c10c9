"""A model-building helper that imports from transformers inside a function, on every rank at
once (the ranks meet at a barrier first): transformers' lazy module resolves the name on
first use, which is not thread-safe on its own."""

import torch.distributed as dist


def build() -> str:
    from transformers import BertConfig

    return type(BertConfig(hidden_size=8, num_attention_heads=2)).__name__


dist.init_process_group("gloo")
dist.barrier()
print(f"rank {dist.get_rank()}: {build()}")
dist.destroy_process_group()
