"""A correct hand-rolled split: indices[rank::world_size], disjoint shards."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(sampler="split"))
