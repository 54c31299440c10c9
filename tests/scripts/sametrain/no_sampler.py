"""Mistake: a DataLoader without DistributedSampler: every rank reads the same batches. Fix:
ok_mlp.py."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(sampler="none"))
