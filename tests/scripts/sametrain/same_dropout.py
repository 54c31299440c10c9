"""Mistake: one seed for every rank: the same dropout masks everywhere. Fix: ok_dropout.py."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(dropout=0.2, seed_per_rank=False))
