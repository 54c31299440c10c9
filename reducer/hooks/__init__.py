"""The built-in comm hooks, as torch keeps them in ``algorithms/ddp_comm_hooks/``.

A hook replaces a bucket's allreduce (``ddp.register_comm_hook(state, hook)``); the protocol
it implements, :class:`reducer.GradBucket` and the future it returns, is the core's
(``reducer.comm_hook``). Here: the plain allreduce, fp16/bf16 compression (hooks and
wrappers), PowerSGD and post-local SGD, each computing what torch's hook of the same name
computes, bit for bit on the fake world.
"""

from __future__ import annotations

from reducer.hooks._default import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)
from reducer.hooks._post_local_sgd import PostLocalSGDState, post_localSGD_hook
from reducer.hooks._powersgd import PowerSGDState, batched_powerSGD_hook, powerSGD_hook

__all__ = [
    "PostLocalSGDState",
    "PowerSGDState",
    "allreduce_hook",
    "batched_powerSGD_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "post_localSGD_hook",
    "powerSGD_hook",
]
