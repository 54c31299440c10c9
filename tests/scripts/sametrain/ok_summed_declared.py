"""A summed loss declared deliberate (say, with a learning rate scaled to match)."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(reduction="sum", deliberate=("summed-loss",)))
