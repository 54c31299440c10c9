"""A script that takes names from a lazily importing package at its top, as scripts that use
transformers do (``from transformers import GPT2LMHeadModel``), and reads another as an
attribute (``transformers.GPT2Config``). See tests/scripts/lazypkg."""

import lazypkg
import torch.distributed as dist
from lazypkg import Model

dist.init_process_group("gloo")
print(f"rank {dist.get_rank()}: {Model.__name__} {lazypkg.Config.__name__}")
dist.destroy_process_group()
