"""Timed parameter storage: a version per chunk of parameters, and pulls that carry only what
changed since the worker's version (TDF §III.B, Fig. 3).

Rules: this module holds, for one model (or one shard of one) on its server, the published
values and one version per chunk of ``chunk`` parameters (:class:`TimedStore`); it builds the
reply to a pull, what changed since the worker's version encoded in whichever layout is
smallest (:meth:`TimedStore.pull`), and applies such a reply to a worker's cached copy in place
(:func:`apply_delta`).  numpy only: no socket, no clock, no thread.  The ``ps`` service decides
when to publish (what a :class:`~fabricd.engines.ps.filters.Publish` names, once per
:class:`~fabricd.engines.ps.consistency.Apply`) and when to answer a pull (a
:class:`~fabricd.engines.ps.consistency.Reply`), moves the bytes, and gives
:func:`apply_delta` a view of the worker's shared-memory segment as the cache.  Malformed reply
bytes raise :class:`~fabricd.errors.RemoteProtocolError` and nothing else, before anything is
written; a wrong argument raises :class:`~fabricd.errors.UsageError`.

Theory of operation.  TDF stores each parameter as ``<theta_j, v_j>``, ``v_j`` the iteration
that last updated it, and a worker's pull returns only the parameters whose version is not less
than the iteration of its previous pull.  Here the model has a *version*, the number of
publishes so far (0: the initial model; the service publishes once per ``Apply``, an empty
publish included, so it equals :mod:`~fabricd.engines.ps.consistency`'s version), and chunk
``c``'s version is the model version that last published it (0: never).  A worker whose cache
is the model at version ``w`` lacks exactly the chunks whose version is greater than ``w``
(TDF's "not less than", its ``w`` being one less than ours).  Version 0 is also a fresh
worker's empty cache: a pull since 0 carries every chunk, the initial values included.  A
worker that pulled the unchanged initial model holds version 0 too, and pulls it whole once
more after the first publish: at most one redundant whole pull, the price of keeping the
numbering equal to the consistency engine's.

A reply built since ``s`` may be applied to a cache at any version ``w`` with ``s <= w <=
version``: it carries every chunk published after ``s``, a superset of those published after
``w``, each with its newest value.  A reply since a later version than the cache's would miss
chunks, and one older than the cache would take chunks back: :func:`apply_delta` refuses both.

Chunks: chunk ``c`` holds parameters ``c * chunk .. min((c + 1) * chunk, count) - 1`` (the last
one may be short); publishing a chunk publishes all of its values.  Measured on 10^6 float32
parameters, a reply one round behind (docs/performance.md, "Timed parameter storage"): its
bytes and the median time to build it, with 1% or 10% of the parameters changed per round,
scattered at random or in runs of 256, and the versions' memory:

=====  ===============  ===============  ===============  ===============  ========
chunk  1% random        1% in runs       10% random       10% in runs      versions
=====  ===============  ===============  ===============  ===============  ========
1      80 kB, 0.4 ms    80 kB, 0.3 ms    525 kB, 1.9 ms   519 kB, 0.7 ms   8 MB
16     606 kB, 0.1 ms   45 kB, 0.03 ms   3.3 MB, 0.5 ms   424 kB, 0.1 ms   500 kB
256    3.7 MB, 0.3 ms   79 kB, 0.02 ms   4.0 MB, 0.2 ms   757 kB, 0.1 ms   31 kB
4096   4.0 MB, 0.2 ms   606 kB, 0.2 ms   4.0 MB, 0.2 ms   3.2 MB, 0.3 ms   2 kB
=====  ===============  ===============  ===============  ===============  ========

Scattered changes, which TDF's P-SMP produces (it keeps or drops each parameter by its own
relative change), make per-parameter replies 6 to 8 times smaller than chunks of 16, and
larger chunks soon send the whole model; changes in runs make chunks of 16 at most 1.8 times
smaller than per parameter.  The bytes matter more than the build time (a millisecond moves
about 3 MB at 25 Gb/s), so :data:`DEFAULT_CHUNK` is 1, at the price of 8 bytes of version per
parameter; chunks of 16 suit models whose updates come in runs (embedding rows, layers).

Reply layout (little-endian; ``n`` chunks, values of ``itemsize`` bytes):

====== ==== ===============================================================================
offset size field
====== ==== ===============================================================================
0      1    encoding (:class:`Encoding`): 0 index list, 1 bitmap, 2 dense
1      1    itemsize of the values: 2, 4 or 8 (float16, float32, float64)
2      2    0 (reserved)
4      4    chunk: parameters per version
8      8    count: parameters of the model
16     8    since: the version the reply was built from
24     8    version: the version it brings the cache to
32     8    carried: chunks whose values follow (every chunk for dense)
40          index list: ``carried`` uint32 chunk indices, strictly ascending, then the values
            of those chunks in that order; bitmap: ``ceil(n / 8)`` bytes, chunk ``c`` is bit
            ``c % 8`` (least significant first) of byte ``c // 8``, unused bits 0, then the
            values of the set chunks in ascending order; dense: every parameter's value
====== ==== ===============================================================================

With ``k`` chunks changed holding ``e`` parameters: index list ``4k + e * itemsize``, bitmap
``ceil(n / 8) + e * itemsize``, dense ``count * itemsize``, each plus the header.  The bitmap
wins from ``k > n / 32``; dense once the unchanged values cost less than the index list or the
bitmap.  Ties go to dense, then the index list (the simpler decodes).

Cost: a pull compares every chunk's version (O(n)) and copies the carried values; applying a
reply copies them.  Memory: the model, plus 8 bytes of version per chunk.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from fabricd.dtypes import FLOAT_DTYPES as DTYPES
from fabricd.engines.ps import snapshot as snap
from fabricd.errors import RemoteProtocolError, UsageError
from fabricd.wire import get_int

Array = np.ndarray[Any, Any]

#: parameters per version unless the caller says otherwise (module docstring: the measurement)
DEFAULT_CHUNK: Final = 1
#: chunk indices travel as uint32: a model has at most this many chunks
MAX_CHUNKS: Final = 2**32
#: a reply's header (module docstring, "Reply layout")
HEADER: Final = struct.Struct("<BBHIQQQQ")

_INDEX: Final = np.dtype("<u4")


class Encoding(enum.IntEnum):
    """How a reply's body says which chunks it carries."""

    INDEX = 0  #: the chunks' uint32 indices, then their values
    BITMAP = 1  #: one bit per chunk of the model, then the set chunks' values
    DENSE = 2  #: every parameter's value, changed or not


#: the order in which equal sizes are preferred: the simpler decode first
_PREFERENCE: Final = (Encoding.DENSE, Encoding.INDEX, Encoding.BITMAP)
_KINDS: Final = frozenset(int(e) for e in Encoding)


@dataclass(frozen=True, slots=True, kw_only=True)
class Delta:
    """What a cache at version ``since`` lacks to be the model at ``version``: the chunks
    ``indices`` (ascending) and their ``values``, concatenated in that order."""

    since: int
    version: int
    chunk: int
    count: int
    indices: Array
    values: Array


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreStatistics:
    """A :class:`TimedStore`'s counters since it was made."""

    version: int
    chunks_published: int
    pulls: int  #: replies built, by encoding below
    index_pulls: int
    bitmap_pulls: int
    dense_pulls: int
    pulled_bytes: int  #: bytes of those replies, headers included


def _float_dtype(dtype: np.dtype[Any], what: str) -> np.dtype[Any]:
    if dtype.name not in DTYPES:
        raise UsageError(f"{what} is float16, float32 or float64, not {dtype}")
    return dtype


def _wire(itemsize: int) -> np.dtype[Any]:
    return np.dtype(f"<f{itemsize}")


def _chunks(count: int, chunk: int) -> int:
    return -(-count // chunk)


def _elements(indices: Array, count: int, chunk: int) -> int:
    """Parameters in chunks ``indices`` (ascending): the last chunk may be short."""
    total = indices.size * chunk
    if indices.size and int(indices[-1]) == _chunks(count, chunk) - 1:
        total -= _chunks(count, chunk) * chunk - count
    return total


def _split(indices: Array, count: int, chunk: int) -> tuple[Array, bool]:
    """The whole chunks among ``indices`` (ascending), and whether the short last one is too."""
    whole = count // chunk
    short = bool(indices.size) and int(indices[-1]) >= whole
    return (indices[:-1] if short else indices), short


def _gather(model: Array, chunk: int, indices: Array, out: Array) -> None:
    """Copy the values of chunks ``indices`` (ascending) of ``model`` into ``out``."""
    if chunk == 1:
        np.take(model, indices, out=out)
        return
    whole, short = _split(indices, model.size, chunk)
    grid = model[: (model.size // chunk) * chunk].reshape(-1, chunk)
    np.take(grid, whole, axis=0, out=out[: whole.size * chunk].reshape(-1, chunk))
    if short:
        out[whole.size * chunk :] = model[grid.size :]


def _scatter(target: Array, chunk: int, indices: Array, values: Array) -> None:
    """Write ``values``, the values of chunks ``indices`` (ascending), into ``target``."""
    if chunk == 1:
        target[indices] = values
        return
    whole, short = _split(indices, target.size, chunk)
    grid = target[: (target.size // chunk) * chunk].reshape(-1, chunk)
    grid[whole] = values[: whole.size * chunk].reshape(-1, chunk)
    if short:
        target[grid.size :] = values[whole.size * chunk :]


class TimedStore:
    """The published values of one model (or shard), starting from ``initial`` (copied) at
    version 0, with one version per ``chunk`` parameters (module docstring).  A ``chunk``
    larger than the model is the whole model.

    Raises:
        UsageError: ``initial`` is not a non-empty 1-d float16/32/64 array, ``chunk`` is not an
            int >= 1, or the model would have more than :data:`MAX_CHUNKS` chunks.
    """

    def __init__(self, initial: Array, *, chunk: int = DEFAULT_CHUNK) -> None:
        self.dtype = _float_dtype(initial.dtype, "a model")
        if initial.ndim != 1 or initial.size == 0:
            raise UsageError(f"a model is a non-empty flat array, not of shape {initial.shape}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise UsageError(f"a chunk has 1 parameter or more, not {chunk!r}")
        self.count = initial.size
        self.chunk = min(chunk, self.count)
        self.chunks = _chunks(self.count, self.chunk)
        if self.chunks > MAX_CHUNKS:
            raise UsageError(
                f"{self.count} parameters in chunks of {self.chunk} make {self.chunks} chunks; "
                f"at most {MAX_CHUNKS} fit the wire's indices: use larger chunks"
            )
        self._model = initial.copy()
        self._versions = np.zeros(self.chunks, np.uint64)
        self._version = self._chunks_published = self._pulled_bytes = 0
        self._pulls = dict.fromkeys(Encoding, 0)

    @property
    def version(self) -> int:
        """The model version: publishes so far."""
        return self._version

    @property
    def model(self) -> Array:
        """The published model (read-only view)."""
        view = self._model.view()
        view.flags.writeable = False
        return view

    @property
    def versions(self) -> Array:
        """Each chunk's version, uint64 (read-only view)."""
        view = self._versions.view()
        view.flags.writeable = False
        return view

    def publish(self, chunks: Array, values: Array) -> int:
        """Publish new ``values`` for ``chunks`` and make them the next model version.

        Args:
            chunks: a boolean mask over the model's chunks, or their indices, strictly
                ascending (a :class:`~fabricd.engines.ps.filters.Publish`'s ``mask``).
            values: the chunks' values concatenated in ascending chunk order, of the model's
                dtype or one it holds exactly (float16 into a float32 model).  Nothing
                published still makes a new version (module docstring).

        Returns:
            The new model version.

        Raises:
            UsageError: a mask of the wrong length, indices that are not strictly ascending
                chunks of the model, or values of the wrong size or of a dtype the model would
                round.  Nothing changed.
        """
        indices = self._chunk_indices(chunks)
        values = np.asarray(values)
        need = _elements(indices, self.count, self.chunk)
        if values.ndim != 1 or values.size != need:
            raise UsageError(f"{indices.size} chunks hold {need} values, not {values.shape}")
        if values.dtype.kind != "f" or not np.can_cast(values.dtype, self.dtype, "safe"):
            raise UsageError(f"values of {values.dtype} do not fit a {self.dtype} model exactly")
        _scatter(self._model, self.chunk, indices, values)
        self._version += 1
        self._versions[indices] = self._version
        self._chunks_published += indices.size
        return self._version

    def _chunk_indices(self, chunks: Array) -> Array:
        chunks = np.asarray(chunks)
        if chunks.dtype == bool:
            if chunks.shape != (self.chunks,):
                raise UsageError(f"a mask over {self.chunks} chunks, not of shape {chunks.shape}")
            return np.flatnonzero(chunks)
        if chunks.ndim != 1 or (chunks.size and chunks.dtype.kind not in "iu"):
            raise UsageError(f"chunks are a boolean mask or 1-d indices, not {chunks.dtype}")
        indices = chunks.astype(np.intp)
        if indices.size and (
            indices[0] < 0 or indices[-1] >= self.chunks or np.any(np.diff(indices) <= 0)
        ):
            raise UsageError(f"chunk indices must be strictly ascending in [0, {self.chunks})")
        return indices

    def _changed(self, since: int) -> Array:
        """The chunks a cache at version ``since`` lacks (every chunk for a fresh cache)."""
        if isinstance(since, bool) or not isinstance(since, int):
            raise UsageError(f"a version is an int, not {since!r}")
        if not 0 <= since <= self._version:
            raise RemoteProtocolError(
                f"a worker holds version {since}; the model is at version {self._version}"
            )
        if since == 0:
            return np.arange(self.chunks)
        return np.flatnonzero(self._versions > since)

    def delta(self, since: int) -> Delta:
        """What a cache at version ``since`` lacks (the whole model when ``since`` is 0).

        Raises:
            RemoteProtocolError: ``since`` is a version the model never had (close that link).
        """
        indices = self._changed(since)
        values = np.empty(_elements(indices, self.count, self.chunk), self.dtype)
        _gather(self._model, self.chunk, indices, values)
        return Delta(
            since=since,
            version=self._version,
            chunk=self.chunk,
            count=self.count,
            indices=indices,
            values=values,
        )

    def sizes(self, since: int) -> dict[Encoding, int]:
        """The bytes of the reply to a pull since ``since`` in each encoding, header included.

        Raises:
            RemoteProtocolError: as :meth:`delta`.
        """
        return self._sizes(self._changed(since))

    def _sizes(self, indices: Array) -> dict[Encoding, int]:
        values = _elements(indices, self.count, self.chunk) * self.dtype.itemsize
        return {
            Encoding.INDEX: HEADER.size + _INDEX.itemsize * indices.size + values,
            Encoding.BITMAP: HEADER.size + -(-self.chunks // 8) + values,
            Encoding.DENSE: HEADER.size + self.count * self.dtype.itemsize,
        }

    def pull(self, since: int, encoding: Encoding | None = None) -> bytearray:
        """The reply to a pull from a cache at version ``since``: the smallest encoding, or
        ``encoding`` if given (module docstring, "Reply layout").

        Raises:
            RemoteProtocolError: as :meth:`delta`.
        """
        indices = self._changed(since)
        sizes = self._sizes(indices)
        kind = min(_PREFERENCE, key=sizes.__getitem__) if encoding is None else encoding
        out = bytearray(sizes[kind])
        carried = self.chunks if kind is Encoding.DENSE else indices.size
        item = self.dtype.itemsize
        fields = (kind, item, 0, self.chunk, self.count, since, self._version, carried)
        HEADER.pack_into(out, 0, *fields)
        offset = HEADER.size
        if kind is Encoding.INDEX:
            np.frombuffer(out, _INDEX, indices.size, offset)[:] = indices
            offset += _INDEX.itemsize * indices.size
        elif kind is Encoding.BITMAP:
            mask = np.zeros(self.chunks, bool)
            mask[indices] = True
            bits = np.packbits(mask, bitorder="little")
            np.frombuffer(out, np.uint8, bits.size, offset)[:] = bits
            offset += bits.size
        values = np.frombuffer(out, _wire(item), (len(out) - offset) // item, offset)
        if kind is Encoding.DENSE:
            values[:] = self._model
        else:
            _gather(self._model, self.chunk, indices, values)
        self._pulls[kind] += 1
        self._pulled_bytes += len(out)
        return out

    def state(self) -> dict[str, Any]:
        """What a replica needs to go on from here (:mod:`fabricd.engines.ps.snapshot`)."""
        return {
            "model": self._model,
            "versions": self._versions,
            "version": self._version,
            "chunks_published": self._chunks_published,
            "pulled_bytes": self._pulled_bytes,
            "pulls": [self._pulls[e] for e in Encoding],
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Take :meth:`state` of a store of the same model and chunks.

        Raises:
            RemoteProtocolError: ``state`` is not such a state, or its versions are not the
                model's (a chunk newer than the model); nothing changed.
        """
        model = snap.array(state, "model", self._model)
        versions = snap.array(state, "versions", self._versions)
        version = get_int(state, "version")
        if versions.size and int(versions.max()) > version:
            raise RemoteProtocolError("a snapshot chunk newer than its model's version")
        pulls = snap.field(state, "pulls", list)
        if len(pulls) != len(Encoding) or not all(type(n) is int and n >= 0 for n in pulls):
            raise RemoteProtocolError("snapshot pull counters of another shape")
        chunks_published = get_int(state, "chunks_published")
        pulled_bytes = get_int(state, "pulled_bytes")
        self._chunks_published, self._pulled_bytes = chunks_published, pulled_bytes
        self._model, self._versions, self._version = model, versions, version
        self._pulls = dict(zip(Encoding, pulls, strict=True))

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(
            version=self._version,
            chunks_published=self._chunks_published,
            pulls=sum(self._pulls.values()),
            index_pulls=self._pulls[Encoding.INDEX],
            bitmap_pulls=self._pulls[Encoding.BITMAP],
            dense_pulls=self._pulls[Encoding.DENSE],
            pulled_bytes=self._pulled_bytes,
        )


# -- worker: decoding a reply ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Parsed:
    encoding: Encoding
    since: int
    version: int
    chunk: int
    indices: Array | None  #: None for dense: every chunk
    values: Array


def _refuse(message: str) -> RemoteProtocolError:
    return RemoteProtocolError(f"malformed pull reply: {message}")


def _parse(data: bytes | bytearray | memoryview, count: int) -> _Parsed:
    """Check every field and length of a reply for a model of ``count`` parameters."""
    view = memoryview(data).cast("B")
    if len(view) < HEADER.size:
        raise _refuse(f"{len(view)} bytes, shorter than the {HEADER.size}-byte header")
    kind, item, reserved, chunk, n, since, version, carried = HEADER.unpack_from(view)
    if kind not in _KINDS:
        raise _refuse(f"unknown encoding {kind}")
    if item not in (2, 4, 8) or reserved:
        raise _refuse(f"values of {item} bytes, reserved field {reserved}")
    if n != count or not 1 <= chunk <= count or since > version:
        raise _refuse(
            f"{n} parameters in chunks of {chunk}, versions {since} to {version}, for a "
            f"cache of {count}"
        )
    chunks = _chunks(count, chunk)
    offset = HEADER.size
    indices: Array | None = None
    if kind == Encoding.INDEX:
        if carried > chunks or len(view) < offset + _INDEX.itemsize * carried:
            raise _refuse(f"{carried} chunk indices in {len(view) - offset} bytes")
        indices = np.frombuffer(view, _INDEX, carried, offset)
        offset += _INDEX.itemsize * carried
        if carried and (int(indices[-1]) >= chunks or np.any(indices[1:] <= indices[:-1])):
            raise _refuse(f"chunk indices not strictly ascending in [0, {chunks})")
    elif kind == Encoding.BITMAP:
        size = -(-chunks // 8)
        if len(view) < offset + size:
            raise _refuse(f"a bitmap of {chunks} chunks in {len(view) - offset} bytes")
        bits = np.unpackbits(np.frombuffer(view, np.uint8, size, offset), bitorder="little")
        offset += size
        indices = np.flatnonzero(bits[:chunks])
        if bits[chunks:].any() or indices.size != carried:
            raise _refuse(f"a bitmap of {indices.size} chunks says {carried}, or sets unused bits")
    elif carried != chunks:
        raise _refuse(f"a dense reply carries all {chunks} chunks, not {carried}")
    values = count if indices is None else _elements(indices, count, chunk)
    if len(view) - offset != values * item:
        raise _refuse(f"{values} values of {item} bytes in {len(view) - offset} bytes")
    return _Parsed(
        Encoding(kind),
        since,
        version,
        chunk,
        indices,
        np.frombuffer(view, _wire(item), values, offset),
    )


def decode(data: bytes | bytearray | memoryview, count: int) -> tuple[Encoding, Delta]:
    """A reply for a model of ``count`` parameters, as its encoding and the :class:`Delta` it
    carries (a dense reply: every chunk).  The arrays are views of ``data``.

    Raises:
        RemoteProtocolError: ``data`` is not a well-formed reply for ``count`` parameters.
    """
    p = _parse(data, count)
    indices = np.arange(_chunks(count, p.chunk)) if p.indices is None else p.indices
    delta = Delta(
        since=p.since,
        version=p.version,
        chunk=p.chunk,
        count=count,
        indices=indices,
        values=p.values,
    )
    return p.encoding, delta


def apply_delta(data: bytes | bytearray | memoryview, cache: Array, version: int) -> int:
    """Apply a pull reply to ``cache``, in place, the worker's copy of the model at
    ``version`` (0: fresh), and return the version it now holds.

    Args:
        data: the reply (:meth:`TimedStore.pull`).
        cache: a writable C-contiguous float16/32/64 array of the model's size, any shape (in
            the service, a view of the worker's shared-memory segment).
        version: the version the cache holds.

    Returns:
        The reply's version, which the cache now holds exactly.

    Raises:
        RemoteProtocolError: the reply is malformed, is not for a model of this size, holds
            values the cache's dtype would round, or does not fit the cache's version (built
            since a later one, or older than it): the cache is untouched; close the link.
        UsageError: ``cache`` is not such an array, or ``version`` is negative.
    """
    if not isinstance(cache, np.ndarray) or not cache.flags.writeable:
        raise UsageError("the cache is a writable numpy array")
    if not cache.flags.c_contiguous or cache.size == 0:
        raise UsageError(f"the cache is a non-empty C-contiguous array, not {cache.shape}")
    _float_dtype(cache.dtype, "the cache")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise UsageError(f"a version is an int >= 0, not {version!r}")
    flat = cache.reshape(-1)
    p = _parse(data, flat.size)
    if not np.can_cast(p.values.dtype, flat.dtype, "safe"):
        raise _refuse(f"values of {p.values.dtype} for a cache of {flat.dtype}")
    if not p.since <= version <= p.version:
        raise _refuse(f"built since version {p.since} up to {p.version}; the cache is at {version}")
    if p.indices is None:
        flat[:] = p.values
    else:
        _scatter(flat, p.chunk, p.indices, p.values)
    return p.version
