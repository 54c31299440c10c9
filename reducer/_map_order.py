"""The order torch's C++ bucketing visits its (dtype, device) keys in.

torch's rebuilt buckets end with the buckets still open, one per key, in the iteration order
of a ``std::unordered_map`` (see Note [Rebuilt buckets are not sorted] in reducer.buckets).
That order is libstdc++'s (torch's Linux builds): a singly linked list in which a key joins
the front of its hash bucket's run, or the front of the list where its hash bucket is empty;
the table starts with 13 hash buckets and is rebuilt (walking the list in order, each key
placed the same way) when the keys outnumber them. The key's hash is c10's ``get_hash(dtype,
device)``. The codes below are c10's ScalarType and DeviceType numbers; a key outside them
takes the plain order (last key seen first), which is libstdc++'s order whenever no two keys
share a hash bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__: list[str] = []

Key = tuple[torch.dtype, torch.device]

_MASK = (1 << 64) - 1
# c10::ScalarType and c10::DeviceType codes of the dtypes and devices parameters live on.
_SCALAR_TYPES = {
    torch.uint8: 0,
    torch.int8: 1,
    torch.int16: 2,
    torch.int32: 3,
    torch.int64: 4,
    torch.float16: 5,
    torch.float32: 6,
    torch.float64: 7,
    torch.complex32: 8,
    torch.complex64: 9,
    torch.complex128: 10,
    torch.bool: 11,
    torch.bfloat16: 15,
}
_DEVICE_TYPES = {"cpu": 0, "cuda": 1, "hip": 6, "xla": 9, "xpu": 12, "mps": 13, "meta": 14}
# libstdc++'s bucket counts: small ones from its table, then primes (>= twice the old count).
_FAST_BUCKETS = (2, 2, 2, 3, 5, 5, 7, 7, 11, 11, 11, 11, 13, 13)


def _key_hash(key: Key) -> int | None:
    """c10's ``get_hash(dtype, device)``: hash_combine(hash(device), hash(dtype)); None for a
    key outside the tables."""
    dtype, device = key
    if dtype not in _SCALAR_TYPES or device.type not in _DEVICE_TYPES:
        return None
    index = -1 if device.index is None else device.index
    seed = (_DEVICE_TYPES[device.type] << 16) | (index & 0xFF)
    value = _SCALAR_TYPES[dtype]
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & _MASK)) & _MASK


def _next_bucket_count(n: int) -> int:
    if n < len(_FAST_BUCKETS):
        return _FAST_BUCKETS[n]
    candidate = n
    while any(candidate % d == 0 for d in range(2, int(candidate**0.5) + 1)):
        candidate += 1
    return candidate


def unordered_map_order(keys: Sequence[Key]) -> list[Key]:
    """``keys`` (distinct, in the order first inserted) in the order a libstdc++
    ``std::unordered_map<BucketKey, ...>`` iterates them."""
    hash_of: dict[Key, int] = {}
    for key in keys:
        code = _key_hash(key)
        if code is None:
            return list(reversed(keys))
        hash_of[key] = code
    buckets, next_resize = 1, 0
    order: list[Key] = []

    def place(key: Key, into: list[Key]) -> None:
        bucket = hash_of[key] % buckets
        for i, other in enumerate(into):
            if hash_of[other] % buckets == bucket:
                into.insert(i, key)  # the front of its bucket's run
                return
        into.insert(0, key)  # an empty bucket: the front of the list

    for key in keys:
        count = len(order) + 1
        if count > next_resize:
            wanted = max(count, 0 if next_resize else 11)  # 11: the first table's minimum
            if wanted >= buckets:
                buckets = _next_bucket_count(max(wanted + 1, buckets * 2))
                next_resize = buckets
                old, order = order, []
                for moved in old:
                    place(moved, order)
            else:
                next_resize = buckets
        place(key, order)
    return order
