"""Mistake: DistributedSampler(num_replicas=1, rank=0): every rank reads the same batches. Fix:
ok_mlp.py."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(sampler="one-replica"))
