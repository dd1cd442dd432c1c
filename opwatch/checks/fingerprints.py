"""Fingerprints of op outputs, for comparing two runs op by op (:func:`opwatch.diff`).

``watch(fingerprints=True)`` binds a :class:`FingerprintTracker`. For each floating, integer
or bool output of an op it queues, on the output's device and without a host sync, five int64
numbers: an exact hash of the values' bits and four statistics (sum, L2 norm, min, max, as
float64 whose bits are carried in int64). At each check point of the watch
(:meth:`~opwatch.checks.ActiveChecks.resolve`) everything queued is read back in one transfer
per device and kept as plain Python numbers, keyed by op index, pruned with the log's ring.

The hash. The values' bits, read as integers of their own width (a float32 as an int32) and
widened to int64, are multiplied by a weight per flat position and summed modulo 2**64. The
weights are odd and pseudo-random (a splitmix-style mix of the position), so a change of any
single value changes the hash (an odd number times a non-zero bit change is non-zero modulo
2**64), and a reordering or several changes collide only by chance (about 2**-64), not by
structure (weights linear in the position would miss a change by ``+1, -2, +1``).

Skipped, because their values are their inputs' (:func:`opwatch.core.ops.facts_of`): views and ops
that keep their input's values (``clone``, ``contiguous``, ``detach``); :func:`opwatch.diff`
follows them to the op that made the values. Also skipped: uninitialised outputs (``empty``),
collectives (their outputs are filled later), and tensors without plain dense values (meta,
sparse, nested, subclasses, zero-tensors). opwatch's own ops run with Python dispatch off.
"""

from __future__ import annotations

import math
import struct
from functools import partial
from typing import NamedTuple

import torch

from ..core.compat import dispatch_modes_outside, dtensor_shard, no_python_dispatch
from ..core.ops import facts_of
from ..core.records import E_INDEX, M_DTYPE, M_DEVICE

__all__ = ["FingerprintTracker", "Fingerprint", "ShardPrint", "encode", "decode", "FIELDS"]



class Fingerprint(NamedTuple):
    """One output's fingerprint, as stored (``None`` where an output was not taken): an exact
    hash of its values' bits and four statistics of its values."""

    hash: int
    sum: float
    norm: float  # L2
    min: float
    max: float


class ShardPrint(NamedTuple):
    """The fingerprint of a ``DTensor`` output's local shard on this rank, with what it takes to
    combine the ranks' shards into the global tensor's statistics (:func:`opwatch.diff` of a
    sharded run against a single-process one): its placement on a 1-D mesh (``"S0"``: sharded
    on dim 0, ``"R"``: replicated, ``"P"``: partial sums), the global shape and the mesh size."""

    hash: int
    sum: float
    norm: float
    min: float
    max: float
    placement: str
    shape: tuple
    ranks: int


FIELDS = Fingerprint._fields
# A row as read (the hash and the statistics' float64 bits, int64 each) -> its Fingerprint.
_ROW, _NUMBERS = struct.Struct("<5q"), struct.Struct("<q4d")
_as_fingerprint = partial(tuple.__new__, Fingerprint)  # Fingerprint(*numbers), without the Python-level call

_PLAIN_TYPES = frozenset((torch.Tensor, torch.nn.Parameter))
_STRIDED = torch.strided
# Dtype -> the integer dtype of the same width its bits are read as.
_BITS = {
    torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
    torch.bfloat16: torch.int16, torch.bool: torch.uint8,
    torch.complex128: torch.int64, torch.complex64: torch.int32,
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _BITS[getattr(torch, _name)] = torch.uint8
_INTEGERS = frozenset((torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64))
_COMPLEX = frozenset((torch.complex64, torch.complex128))
_TAKEN = frozenset(_BITS) | _INTEGERS

_WEIGHTS_CACHED = 1 << 22  # positions of the cached weights per device (32 MiB of int64)
_MIX1 = -0x40A7B892E31B1A47  # 0xBF58476D1CE4E5B9 as a signed int64
_MIX2 = -0x6B2FB644ECCEEE15  # 0x94D049BB133111EB as a signed int64


def _weights(count: int, device) -> torch.Tensor:
    """``count`` odd pseudo-random int64 weights, one per flat position (splitmix64's finaliser;
    the shifts are arithmetic, which mixes as well)."""
    x = torch.arange(1, count + 1, dtype=torch.int64, device=device) * _MIX1
    x = x ^ (x >> 30)
    x = x * _MIX2
    x = x ^ (x >> 27)
    return x | 1


class FingerprintTracker:
    """Queues fingerprints of op outputs on their devices; reads them at check points."""

    _CHUNK = 64  # fingerprints stacked into one tensor at a time

    def __init__(self, log, store: dict) -> None:
        self._log = log
        self.store = store  # op index -> tuple of Fingerprint or None per output (the Watch's)
        self._rows: list[tuple] = []  # (hash, stats) pairs on _device
        self._device = None
        self._chunks: list[torch.Tensor] = []
        self._keys: list[tuple] = []  # (op index, output position, output count) per row
        self._weights: dict = {}  # device -> cached weights

    def for_op(self, func):
        """The observer for ``func``'s outputs; ``None`` for ops whose outputs hold their inputs'
        values (views, clones), uninitialised memory, or a collective's later result."""
        facts = facts_of(func)
        if facts.is_view or facts.keeps_values or facts.makes_new_data or facts.collective is not None:
            return None
        return self._observe

    @property
    def pending(self) -> int:
        return len(self._keys)

    def _observe(self, entry, inputs, outputs, metas) -> None:
        """Hot path, inside the mode's ``__torch_dispatch__``: queue one row per output taken.
        No host sync."""
        if dispatch_modes_outside():
            with no_python_dispatch():  # modes entered outside opwatch must not see these ops
                self._queue(entry[E_INDEX], outputs, metas)
        else:
            self._queue(entry[E_INDEX], outputs, metas)

    def _queue(self, index, outputs, metas) -> None:
        count = len(outputs)
        for position, tensor in enumerate(outputs):
            meta = metas[position]
            dtype = meta[M_DTYPE]
            if dtype not in _TAKEN:
                continue
            shard = None
            if type(tensor) not in _PLAIN_TYPES:  # a DTensor: its local shard, with its placement
                found = dtensor_shard(tensor)
                if found is None:
                    continue
                tensor, (kind,), shape, ranks = found
                letter, dim = kind
                shard = (f"{letter}{dim}" if letter == "S" else letter, shape, ranks)
                if type(tensor) not in _PLAIN_TYPES:
                    continue
            if tensor.is_meta:
                continue
            if tensor.layout is not _STRIDED or tensor.is_nested or not tensor.numel() or tensor._is_zerotensor():
                continue
            device = meta[M_DEVICE]
            if device != self._device:
                self._stack()  # one chunk per device run
                self._device = device
            self._rows.append(self._fingerprint(tensor.detach(), dtype, device))
            self._keys.append((index, position, count, shard))
            if len(self._rows) >= self._CHUNK:
                self._stack()

    def _fingerprint(self, tensor, dtype, device) -> tuple:
        """The hash (0-dim int64) and the statistics (sum, norm, min, max: 4 floats), queued
        apart and joined per chunk into rows of five int64 (``_stack``)."""
        if dtype in _COMPLEX:
            tensor = torch.view_as_real(tensor.resolve_conj())
        flat = tensor.reshape(-1)
        bits = flat if dtype in _INTEGERS else flat.view(_BITS[dtype])
        count = flat.numel()
        weights = self._weights.get(device)
        if weights is None or weights.numel() < count:
            if count > _WEIGHTS_CACHED:  # not cached: a few elementwise ops on this size
                weights = _weights(count, device)
            else:  # the same weights, position by position, in a longer table
                size = min(_WEIGHTS_CACHED, max(count, 4096, 0 if weights is None else 2 * weights.numel()))
                weights = self._weights[device] = _weights(size, device)
        wide = bits.to(torch.int64)
        # One fused kernel on the CPU; CUDA has no integer dot.
        hashed = torch.dot(wide, weights[:count]) if flat.is_cpu else (wide * weights[:count]).sum()
        if not flat.is_floating_point() or flat.element_size() == 1:  # integers, bool, float8
            values, accumulate = flat.to(torch.float32), None
        else:  # float16 and bfloat16 sums accumulate in float32: no overflow, fewer roundings
            values, accumulate = flat, (torch.float32 if flat.element_size() == 2 else None)
        low, high = torch.aminmax(values)
        total = values.sum(dtype=accumulate)
        norm = torch.linalg.vector_norm(values, dtype=accumulate)
        return hashed, torch.stack((total, norm, low.to(total.dtype), high.to(total.dtype)))

    def _stack(self) -> None:
        if self._rows:
            hashes = torch.stack([hashed for hashed, _ in self._rows]).reshape(-1, 1)
            # float32 and float64 statistics: stack promotes them to float64 (exactly).
            stats = torch.stack([stats for _, stats in self._rows]).to(torch.float64).view(torch.int64)
            self._chunks.append(torch.cat((hashes, stats), dim=1))
            self._rows = []

    def resolve(self) -> None:
        """Check point: read every queued row, one transfer per device, into ``store``; drop
        the fingerprints of ops that left the log's ring."""
        if self._keys:
            with no_python_dispatch():
                self._stack()
                numbers = self._read()
            keys, self._keys, self._chunks, self._device = self._keys, [], [], None
            store = self.store
            for (index, position, count, shard), row in zip(keys, numbers):
                prints = store.get(index)
                if prints is None:
                    prints = store[index] = [None] * count
                found = _as_fingerprint(_NUMBERS.unpack(_ROW.pack(*row)))
                prints[position] = found if shard is None else ShardPrint(*found, *shard)
        entries = self._log.entries
        if entries and len(self.store) > entries.maxlen:
            oldest = entries[0][E_INDEX]
            for index in [index for index in self.store if index < oldest]:
                del self.store[index]

    def _read(self) -> list:
        by_device: dict = {}
        for number, chunk in enumerate(self._chunks):
            by_device.setdefault(chunk.device, []).append(number)
        rows: list = [None] * len(self._chunks)
        for numbers in by_device.values():
            chunks = [self._chunks[number] for number in numbers]
            values = (torch.cat(chunks) if len(chunks) > 1 else chunks[0]).tolist()  # the one read
            start = 0
            for number, chunk in zip(numbers, chunks):
                rows[number] = values[start : start + len(chunk)]
                start += len(chunk)
        return [row for chunk_rows in rows for row in chunk_rows]


# -- in a saved log: JSON numbers, non-finite statistics as strings ------------------------------


def encode(prints) -> list:
    """A record's fingerprints for a JSON line: ``[[hash, sum, norm, min, max] | null, ...]``;
    a DTensor shard's with a sixth item, ``{"placement": "S0", "shape": [...], "ranks": 2}``."""
    return [None if found is None else _encode_one(found) for found in prints]


def _encode_one(found) -> list:
    numbers = [found.hash, *map(_encode_float, (found.sum, found.norm, found.min, found.max))]
    if isinstance(found, ShardPrint):
        numbers.append({"placement": found.placement, "shape": list(found.shape), "ranks": found.ranks})
    return numbers


def decode(fields) -> tuple:
    """The inverse of :func:`encode`."""
    return tuple(None if found is None else _decode_one(*found) for found in fields)


def _decode_one(hashed, *stats) -> Fingerprint:
    if len(stats) == 5:  # a DTensor shard's
        *stats, shard = stats
        return ShardPrint(int(hashed), *map(_decode_float, stats), shard["placement"], tuple(shard["shape"]), int(shard["ranks"]))
    return Fingerprint(int(hashed), *map(_decode_float, stats))


def _encode_float(value: float):
    return value if math.isfinite(value) else ("nan" if math.isnan(value) else ("inf" if value > 0 else "-inf"))


def _decode_float(value) -> float:
    return float(value)
