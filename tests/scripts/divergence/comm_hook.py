"""A communication hook that reduces wrongly: it sums without dividing by the world size
("sum"), divides twice ("twice"), or returns the first bucket unreduced ("drop"). Fixed:
scale by 1/world size, then allreduce, as DDP does without a hook."""

import torch
import torch.distributed as dist
from _common import batch, finish, model, parse, setup, wrap


def hook_for(variant: str, world_size: int):  # type: ignore[no-untyped-def]
    def hook(state: object, bucket):  # type: ignore[no-untyped-def]
        buffer = bucket.buffer()
        if variant == "drop" and bucket.index() == 0:
            future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            future.set_result(buffer)
            return future
        if variant in ("fixed", "drop"):
            buffer.mul_(1.0 / world_size)
        elif variant == "twice":
            buffer.mul_(1.0 / world_size).mul_(1.0 / world_size)
        work = dist.all_reduce(buffer, async_op=True)
        return work.get_future().then(lambda f: f.value()[0])

    return hook


def main() -> None:
    args = parse(__doc__, variants=("sum", "twice", "drop", "fixed"))
    rank, world_size = setup()
    net = model()
    # Small buckets: the two layers' gradients go in different buckets.
    ddp = wrap(net, args.ddp, bucket_cap_mb=1e-4)
    ddp.register_comm_hook(None, hook_for(args.variant, world_size))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(args.steps):
        ddp(batch(rank, step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    finish(net)


if __name__ == "__main__":
    main()
