"""Mistake: a hand-rolled split whose shards overlap. Fix: ok_split.py."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(sampler="overlap"))
