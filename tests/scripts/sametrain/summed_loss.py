"""Mistake: the loss is a sum over the local batch: each step is 1/W of one process's. Fix:
ok_mlp.py."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(reduction="sum"))
