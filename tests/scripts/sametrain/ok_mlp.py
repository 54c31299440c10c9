"""A correct script: DistributedSampler with set_epoch, a mean loss divided by the accumulation
steps once."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options())
