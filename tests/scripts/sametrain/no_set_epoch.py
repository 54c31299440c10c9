"""Mistake: sampler.set_epoch(epoch) never called: the shuffle repeats every epoch.
Fix: ok_mlp.py."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(set_epoch=False))
