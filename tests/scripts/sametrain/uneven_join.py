"""Mistake: uneven inputs under DDP's join(): the last rank runs out of batches first, and the
others' last step is averaged with its zeros (1/W of one process's on those batches). Fix:
ok_split.py (equal shards)."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(sampler="join", accumulation=1))
