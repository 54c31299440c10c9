"""Mistake: 47 samples (the last batch of each epoch is short on every rank alike): the
DistributedSampler pads them to 48, reading one sample twice per epoch. Fix: ok_mlp.py (or
DistributedSampler(drop_last=True))."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(samples=47))
