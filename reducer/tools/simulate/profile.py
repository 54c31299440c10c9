"""A profile: one rank's step measured where the job runs, as the prediction takes it.

Per parameter (in ``model.parameters()`` order) its name, shape and when its gradient was
ready, in ms from the start of backward; forward and optimizer time in ms. Stored as JSON
(format ``ddp-reducer-profile/1``); :meth:`Profile.check_matches` refuses a profile of another
model, naming the first field that differs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

__all__ = ["PROFILE_FORMAT", "Profile"]

PROFILE_FORMAT = "ddp-reducer-profile/1"


@dataclass(frozen=True, slots=True)
class Profile:
    """One rank's measured step: per parameter (in ``model.parameters()`` order) its name,
    shape and when its gradient was ready, in ms from the start of backward; forward and
    optimizer time in ms. Stored as JSON (:meth:`save`, :meth:`load`)."""

    model: str
    device: str
    batch_size: int
    forward_ms: float
    optimizer_ms: float
    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    ready_ms: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "model": self.model,
            "device": self.device,
            "batch_size": self.batch_size,
            "forward_ms": self.forward_ms,
            "optimizer_ms": self.optimizer_ms,
            "params": [
                {"name": n, "shape": list(s), "ready_ms": r}
                for n, s, r in zip(self.names, self.shapes, self.ready_ms, strict=True)
            ],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """A profile from this project's JSON at ``path``; ValueError naming the field that
        is missing or wrong (a torch.profiler trace: ``cluster.load_profile``)."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"profile {path}: cannot read it as JSON: {exc}") from exc
        if isinstance(data, dict) and "traceEvents" in data:
            raise ValueError(
                f"profile {path} is a torch.profiler trace: load it with "
                "cluster.load_profile(path, model=...), which matches it to the model"
            )
        return cls.from_json(data, source=str(path))

    @classmethod
    def from_json(cls, data: Any, *, source: str = "profile") -> Profile:
        def need(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
            if not isinstance(obj, dict) or key not in obj:
                raise ValueError(f"{source}: {where}{key} is missing")
            if not isinstance(obj[key], kind) or isinstance(obj[key], bool):
                raise ValueError(f"{source}: {where}{key} has the wrong type: {obj[key]!r}")
            return obj[key]

        if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
            raise ValueError(f"{source}: format must be {PROFILE_FORMAT!r}")
        params = need(data, "params", list, "")
        names, sizes, ready = [], [], []
        for i, entry in enumerate(params):
            where = f"params[{i}]."
            names.append(need(entry, "name", str, where))
            shape = need(entry, "shape", list, where)
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ValueError(f"{source}: {where}shape must be a list of sizes: {shape!r}")
            sizes.append(tuple(shape))
            value = float(need(entry, "ready_ms", (int, float), where))
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"{source}: {where}ready_ms must be >= 0, got {value!r}")
            ready.append(value)
        times = {}
        for key in ("forward_ms", "optimizer_ms"):
            times[key] = float(need(data, key, (int, float), ""))
            if not (times[key] >= 0 and math.isfinite(times[key])):
                raise ValueError(f"{source}: {key} must be >= 0, got {times[key]!r}")
        return cls(
            model=need(data, "model", str, ""),
            device=str(data.get("device", "")),
            batch_size=int(need(data, "batch_size", int, "")),
            forward_ms=times["forward_ms"],
            optimizer_ms=times["optimizer_ms"],
            names=tuple(names),
            shapes=tuple(sizes),
            ready_ms=tuple(ready),
        )

    def check_matches(self, model: str, params: Sequence[tuple[str, Tensor]]) -> None:
        """ValueError naming the first field where this profile and the model differ."""
        if self.model != model:
            raise ValueError(f"profile: model is {self.model!r}, the prediction's is {model!r}")
        if len(self.names) != len(params):
            raise ValueError(
                f"profile: params has {len(self.names)} entries, model {model!r} has "
                f"{len(params)} parameters; measure the profile on this model"
            )
        for i, ((name, p), mine, shape) in enumerate(
            zip(params, self.names, self.shapes, strict=True)
        ):
            if mine != name:
                raise ValueError(f"profile: params[{i}].name is {mine!r}, the model's {name!r}")
            if tuple(p.shape) != shape:
                raise ValueError(
                    f"profile: params[{i}].shape ({name}) is {list(shape)}, the model's "
                    f"{list(p.shape)}"
                )
