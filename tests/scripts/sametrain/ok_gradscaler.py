"""A correct script with a GradScaler: the loss is scaled for backward, the gradients unscaled
before the step (the scale is not a loss scale)."""

from sametrain_common import Options, main

if __name__ == "__main__":
    main(Options(amp=True))
