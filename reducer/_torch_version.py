"""Which torch this package supports, and the refusal of any older one.

The supported range starts at the oldest torch the whole test suite has been run on and
passed (docs/howto/torch-versions.md). Older releases are refused when ``reducer`` is
first imported (``fakepg`` imports it too), before any module uses an API they may lack: on
them the package does not merely fail to start, some of its features hang or compute wrong
gradients (torch 2.4.1: torch's DDP hangs under ``launch`` past its timeout, gradients under
reentrant checkpointing are wrong), which is worse than a clear error. Newer releases than the
newest tested are accepted: torch keeps the public APIs used here, and the suite says if not.
"""

from __future__ import annotations

import os
import re

import torch

__all__ = ["MINIMUM", "TESTED", "require_supported_torch", "torch_minor"]

# The torch minors the full suite has been run on, oldest first; each has a tox environment
# (torch211 ...) and a row in docs/howto/torch-versions.md. The first is the floor.
TESTED: tuple[tuple[int, int], ...] = ((2, 11), (2, 12), (2, 13), (2, 14))
MINIMUM: tuple[int, int] = TESTED[0]


def torch_minor(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version string (``2.11.0+cu130``, ``2.12.0a0+git1234``),
    or None where it does not start with two numbers."""
    match = re.match(r"(\d+)\.(\d+)(?!\d)", version)
    return (int(match[1]), int(match[2])) if match else None


def _dotted(minor: tuple[int, int]) -> str:
    return f"{minor[0]}.{minor[1]}"


def require_supported_torch() -> None:
    """Raise RuntimeError, naming the installed and the needed versions, unless the installed
    torch (``torch.__version__``, read at call time) is at least :data:`MINIMUM`."""
    installed = str(torch.__version__)
    minor = torch_minor(installed)
    if minor is not None and minor >= MINIMUM:
        return
    where = os.path.dirname(torch.__file__ or "") or "unknown location"
    if minor is None:
        found = f"torch whose version {installed!r} cannot be read as major.minor"
    else:
        found = f"torch {installed}"
    tested = ", ".join(_dotted(m) for m in TESTED)
    raise RuntimeError(
        f"ddp-reducer needs torch >= {_dotted(MINIMUM)}, but this is {found} (at {where}). "
        f"Older torch is refused because some features hang or compute wrong gradients on it. "
        f"Install a supported torch, e.g. pip install 'torch>={_dotted(MINIMUM)}' "
        f"(tested: {tested})."
    )


# Refused at import, before any other module of the package touches torch.
require_supported_torch()
