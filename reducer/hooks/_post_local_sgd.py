"""Post-local SGD as a comm hook: torch's ``post_localSGD_hook``, over any ProcessGroup.

A port of ``torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook`` (Lin et al.,
"Don't use large mini-batches, use local SGD", ICLR 2020): gradients are averaged over the
whole group for the first ``start_localSGD_iter`` iterations, then only within a subgroup
(e.g. the ranks of one machine), or not at all; a model averager run after the optimizer step
then averages the parameters globally from time to time.

The one difference from torch: the reducer's process-group protocol cannot create groups, so
torch's default subgroup (``subgroup=None``: the ranks of each machine, from
``torch.distributed.new_subgroups()``) is not available. With ``subgroup=None`` the global group
is used after ``start_localSGD_iter`` as well (plain DDP), and the state warns about it at
construction. Pass the subgroup explicitly: ``reducer.TorchProcessGroup(dist.new_subgroups()[0])``
on torch.distributed (or the group itself), or another fake world's group on the fake world.
"""

from __future__ import annotations

import logging
import numbers
import warnings

import torch
from torch import Tensor

from reducer.comm_hook import GradBucket, completed
from reducer.errors import InvalidArgument
from reducer.hooks._default import allreduce_divided, as_process_group

__all__ = ["PostLocalSGDState", "post_localSGD_hook"]

logger = logging.getLogger(__name__)


class PostLocalSGDState:
    """Global allreduce until ``start_localSGD_iter``, then within ``subgroup`` (torch's names).

    ``process_group``: the global group (None: the reducer's own). ``subgroup``: the group to
    average within afterwards; None falls back on the global group, with a warning (see the
    module's docstring). ``post_local_gradient_allreduce=False`` stops averaging gradients
    altogether after ``start_localSGD_iter``.
    """

    __slots__ = [
        "iter",
        "post_local_gradient_allreduce",
        "process_group",
        "start_localSGD_iter",
        "subgroup",
    ]

    def __init__(
        self,
        process_group: object,
        subgroup: object,
        start_localSGD_iter: int,
        post_local_gradient_allreduce: bool = True,
    ) -> None:
        start: object = start_localSGD_iter  # checked as what a caller may pass
        if isinstance(start, bool) or not isinstance(start, numbers.Integral) or start < 0:
            raise InvalidArgument(
                f"PostLocalSGDState: start_localSGD_iter must be an int >= 0, got "
                f"{start_localSGD_iter!r}"
            )
        if subgroup is None and post_local_gradient_allreduce:
            warnings.warn(
                "PostLocalSGDState: subgroup=None; torch would average within the ranks of each "
                "machine after start_localSGD_iter (torch.distributed.new_subgroups()), which "
                "this process-group protocol cannot create, so the global group is used "
                "throughout (plain DDP). Pass subgroup= the group to average within, e.g. "
                "reducer.TorchProcessGroup(torch.distributed.new_subgroups()[0])",
                UserWarning,
                stacklevel=2,
            )
        self.process_group: object = process_group
        self.subgroup: object = subgroup
        self.start_localSGD_iter: int = int(start)
        self.post_local_gradient_allreduce: bool = bool(post_local_gradient_allreduce)
        self.iter: int = 0
        logger.info("Local SGD will be started after %s iterations", start_localSGD_iter)

    def maybe_increase_iter(self, bucket: GradBucket) -> None:
        """Count an iteration when its last bucket is reduced."""
        if bucket.is_last():
            self.iter += 1
        if self.iter == self.start_localSGD_iter:
            logger.info("Start to apply local SGD after %s iterations.", self.iter)


def post_localSGD_hook(
    state: PostLocalSGDState, bucket: GradBucket
) -> torch.futures.Future[Tensor]:
    """Average over ``state.process_group`` for ``start_localSGD_iter`` iterations, then over
    ``state.subgroup`` (or keep the local gradients, with ``post_local_gradient_allreduce=
    False``). Pair it with a model averager after the optimizer step."""
    buffer = bucket.buffer()
    if state.iter < state.start_localSGD_iter:
        state.maybe_increase_iter(bucket)
        group = (
            bucket._process_group
            if state.process_group is None
            else as_process_group(state.process_group, "PostLocalSGDState.process_group")
        )
        return allreduce_divided(group, buffer)
    if not state.post_local_gradient_allreduce:
        return completed(buffer)  # local gradients, undivided: nothing was reduced
    subgroup = state.subgroup if state.subgroup is not None else state.process_group
    group = (
        bucket._process_group
        if subgroup is None
        else as_process_group(subgroup, "PostLocalSGDState.subgroup")
    )
    return allreduce_divided(group, buffer)
