"""Mistake: one seed for every rank: the same random augmentation everywhere. Fix: ok_augment.py."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(augment=True, seed_per_rank=False))
