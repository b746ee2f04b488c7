"""The backend interface: what a checkpoint load asks of any store, in one module every backend
and :mod:`~hp_dcp_hf.storage.transport.location` depend on (and which depends on none of them).

* :class:`Backend`: metadata (``locate``, ``isfile``, ``size``/``stat``, ``list_files``) and
  :meth:`Backend.open`, the one call every rank makes;
* :class:`RangeFile`: one open file read by absolute byte ranges into the caller's buffers;
* :class:`FileVersion` and :func:`changed_error`: a file as its header described it, and the error
  of one that changed since;
* :class:`RetryPolicy` and :class:`TransientError`: how remote reads retry, and
  :class:`FirstAnswer`: a store that never answered fails at once, as :class:`UnreachableError`;
* :func:`read_ranged`: the resumable loop of ranged answers whose bodies are read straight into
  the caller's buffers, shared by the HTTP(S), Hub and S3 backends.
"""

from __future__ import annotations

import contextlib
import functools
import posixpath
import random
import re
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from fsspec import AbstractFileSystem

from hp_dcp_hf.errors import CheckpointNotFoundError, HPDCPHFError, StorageReadError

T = TypeVar("T")


REMOTE_COALESCE_GAP = 2**20
"""Default coalescing gap of remote stores: a request costs a round trip (tens of ms on S3), in
which a connection moves about a megabyte, so reading and dropping a hole up to that size is
cheaper than a request of its own. A TP row-sharded box is then one request per staging batch
instead of one per row."""

_READ_CHUNK = 1 << 20
"""Most bytes asked of one ``readinto`` of a response body (straight into the destination)."""


# -- file versions --------------------------------------------------------------------------------


def changed_error(file: str, detail: str) -> StorageReadError:
    """The error of a file whose bytes are no longer those its header described."""
    return StorageReadError(
        f"changed since its header was read ({detail}); it was modified during the load, load it again "
        "once it is complete",
        file=file,
    )


@dataclass(frozen=True)
class FileVersion:
    """A checkpoint file as it was when its header was read: its size and a version tag.

    ``tag`` is what the backend got for free with the size (local: mtime and inode; S3 and HTTP:
    the ETag; Hub: the commit), ``None`` when it gave none. ``scope`` says where the tag means
    something: a host name for local tags (another machine's copy of the same path has its own
    mtime and inode, so only the size is checked there), ``None`` for tags valid everywhere.
    """

    size: int
    tag: str | None = None
    scope: str | None = None

    def check(self, file: str, *, size: int | None = None, tag: str | None = None) -> None:
        """Raise :func:`changed_error` unless ``size`` and ``tag`` (where given) match this version."""
        if size is not None and size != self.size:
            raise changed_error(file, f"size {self.size} -> {size}")
        if tag is not None and self.tag is not None and tag != self.tag and self.scope in (None, host_name()):
            raise changed_error(file, f"version {self.tag} -> {tag}, size {self.size} unchanged")

    def to_json(self) -> list[Any]:
        return [self.size, self.tag, self.scope]

    @classmethod
    def from_json(cls, value: Sequence[Any]) -> FileVersion:
        size, tag, scope = value
        return cls(int(size), tag, scope)


@functools.cache
def host_name() -> str:
    """This machine's name: the scope of local version tags."""
    return socket.gethostname()


class RangeFile:
    """One open checkpoint file, read by absolute byte ranges. Thread-safe: reads are positional."""

    def __init__(self, file: str) -> None:
        self.file = file

    def read(self, start: int, end: int) -> bytes:
        """Exactly the bytes ``[start, end)``; a short read raises :class:`StorageReadError`."""
        buf = bytearray(end - start)
        self.read_into(start, [buf])
        return bytes(buf)

    def read_into(self, start: int, buffers: Sequence[Any]) -> None:
        """Fill ``buffers`` (writable, C-contiguous) in order from the bytes starting at ``start``.
        A read that fails may have filled some of them: its error says how many bytes, where the
        backend knows, as :func:`transferred` sets it."""
        raise NotImplementedError

    def mapped(self, start: int, end: int) -> memoryview | None:
        """Bytes ``[start, end)`` mapped into memory, for backends that can (:attr:`Backend.mappable`);
        ``None`` for the others. The mapping lives as long as the view (and what is made of it)."""
        return None

    def advise(self, start: int, end: int) -> None:
        """Tell the store that bytes ``[start, end)`` will be read soon (local files: the kernel's
        ``posix_fadvise(WILLNEED)`` readahead); nothing where it cannot be told."""

    def use_direct_io(self) -> bool:
        """Read the rest with ``O_DIRECT`` (around the page cache) where the file allows it; whether it does."""
        return False

    def close(self) -> None:
        """Release what the handle holds."""

    def __enter__(self) -> RangeFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _short(self, start: int, end: int, got: int) -> StorageReadError:
        return StorageReadError(
            f"short read: {got} of {end - start} bytes at [{start}, {end})", file=self.file
        )


def fill_views(views: list[memoryview], position: tuple[int, int], data: memoryview) -> tuple[int, int]:
    """Copy ``data`` into ``views`` from ``position`` (view index, offset); the position after it."""
    index, offset = position
    taken = 0
    while taken < len(data):
        view = views[index]
        n = min(view.nbytes - offset, len(data) - taken)
        view[offset : offset + n] = data[taken : taken + n]
        taken += n
        offset += n
        if offset == view.nbytes:
            index, offset = index + 1, 0
    return index, offset


# -- backends -------------------------------------------------------------------------------------


class Backend:
    """What a checkpoint load asks of its storage; one subclass per kind of store.

    ``path`` arguments are in the backend's own terms (what :func:`filesystem` returned, or a
    :meth:`join` of a root and a file name). Every method may do I/O except :meth:`open` and
    :meth:`join`: those run on every rank, from metadata another rank may have resolved.
    """

    fs: AbstractFileSystem | None = None
    """The fsspec filesystem behind the backend, when there is one."""
    local: bool = False
    """Paths of this backend are this machine's local files."""
    mappable: bool = False
    """Handles of this backend map files into memory (:meth:`RangeFile.mapped`)."""
    coalesce_gap: int = REMOTE_COALESCE_GAP
    """The reader's default coalescing gap on this store (0 for local files: a read costs no round trip)."""

    def join(self, root: str, file: str) -> str:
        return posixpath.join(root, file) if root else file

    def shared(self, root: str) -> bool:
        """Whether other machines read ``root`` from the same storage, so that ranks reading it
        each for themselves move its bytes once per rank: remote stores always."""
        return not self.local

    def url(self, path: str) -> str:
        """``path`` as errors name it: as the user would write it, scheme included (``path`` itself here)."""
        return path

    def locate(self, path: str) -> tuple[str, str | None]:
        """The checkpoint root of ``path`` and, when it names one file, that file's name.

        A backend may pin the root here (a Hub revision becomes its commit), so that every rank
        reading files under the returned root reads the same bytes.
        """
        if self.isfile(path):
            return posixpath.dirname(path), posixpath.basename(path)
        if self.isdir(path):
            return path, None
        if self.local:
            raise CheckpointNotFoundError("does not exist locally (no such file or directory)", file=path)
        raise CheckpointNotFoundError("no such file or directory", file=self.url(path))

    def isfile(self, path: str) -> bool:
        raise NotImplementedError

    def isdir(self, path: str) -> bool:
        raise NotImplementedError

    def size(self, path: str) -> int:
        """The size of the file at ``path``; ``FileNotFoundError`` when it does not exist."""
        raise NotImplementedError

    def stat(self, path: str) -> FileVersion:
        """The size of the file at ``path`` and whatever version tag came with it, at no extra cost;
        ``FileNotFoundError`` when it does not exist. Without a tag of its own: the size alone."""
        return FileVersion(self.size(path))

    def list_files(self, root: str) -> list[str]:
        """Names of the plain files directly under ``root``, sorted."""
        raise NotImplementedError

    def open(self, path: str, file: str, expected: FileVersion | None = None) -> RangeFile:
        """A handle for ranged reads of the file at ``path`` (named ``file`` in errors); no I/O.

        With ``expected`` (what :meth:`stat` said when the header was read, maybe on another rank),
        reads raise :func:`changed_error` when the file is no longer that version, checked from
        what the reads see anyway (no extra request).
        """
        raise NotImplementedError


# -- retry policy ---------------------------------------------------------------------------------


class TransientError(StorageReadError):
    """A failure worth retrying (HTTP 5xx/429, dropped connection, truncated body)."""

    def __init__(self, reason: str, *, file: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(reason, file=file)
        self.retry_after = retry_after


class UnreachableError(StorageReadError):
    """No answer came from the store at all (connection refused, no route, name not resolved, timeouts),
    on every try: nothing was found missing or refused, so errors say so rather than "answered"."""


@dataclass(frozen=True)
class RetryPolicy:
    """How remote reads retry: ``attempts`` tries per request within ``deadline_s``.

    Waits start at ``backoff_s`` and double up to ``max_backoff_s``, each drawn uniformly from
    its upper half (jitter, so ranks and threads do not retry in lockstep); a ``Retry-After``
    header lengthens a wait up to ``max_backoff_s``. ``connect_timeout_s`` and ``read_timeout_s``
    bound each HTTP(S), Hub and S3 data try (S3 ``config_kwargs={"connect_timeout": ...,
    "read_timeout": ...}`` in the storage options take precedence). So a persistent failure raises
    after at most about ``deadline_s`` plus one try's timeouts.

    A store that has not answered yet is different: until its first answer (:class:`FirstAnswer`),
    a request that gets none at all (connection refused, timed out, host not found) is not retried
    and waits at most ``first_answer_timeout_s`` to connect and for the answer, so a wrong endpoint
    or a dead host fails in seconds with :class:`UnreachableError`, not after the retry budget.
    """

    attempts: int = 5
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    deadline_s: float = 120.0
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 60.0
    first_answer_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or min(self.backoff_s, self.max_backoff_s, self.deadline_s) < 0:
            raise ValueError(f"a retry policy needs attempts >= 1 and non-negative times, got {self}")
        if min(self.connect_timeout_s, self.read_timeout_s, self.first_answer_timeout_s) <= 0:
            raise ValueError(f"a retry policy needs positive timeouts, got {self}")

    @classmethod
    def of(cls, value: RetryPolicy | Mapping[str, Any] | None) -> RetryPolicy:
        """``value`` itself, a policy from a dict of its fields, or the default policy."""
        if value is None:
            return cls()
        if isinstance(value, RetryPolicy):
            return value
        unknown = set(value) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown retry policy fields {sorted(unknown)}; known: {[f.name for f in fields(cls)]}")
        return cls(**value)

    @property
    def timeout(self) -> tuple[float, float]:
        return (self.connect_timeout_s, self.read_timeout_s)

    @property
    def first_timeout(self) -> tuple[float, float]:
        """The (connect, read) timeouts of a request to a store that has not answered yet."""
        return (min(self.connect_timeout_s, self.first_answer_timeout_s),
                min(self.read_timeout_s, self.first_answer_timeout_s))

    def run(
        self,
        attempt: Callable[[], T],
        *,
        what: str,
        file: str | None,
        is_transient: Callable[[BaseException], bool] | None = None,
    ) -> T:
        """``attempt()``, retried while it raises :class:`TransientError` or what ``is_transient`` accepts."""
        start = time.monotonic()
        delay = self.backoff_s
        tries = 0
        while True:
            tries += 1
            try:
                return attempt()
            except Exception as error:
                transient = isinstance(error, TransientError) or (
                    is_transient is not None and not isinstance(error, HPDCPHFError) and is_transient(error)
                )
                if not transient:
                    raise
                elapsed = time.monotonic() - start
                wait = delay * random.uniform(0.5, 1.0)
                retry_after = getattr(error, "retry_after", None)
                if retry_after is not None:
                    wait = max(wait, min(retry_after, self.max_backoff_s))
                if tries >= self.attempts or elapsed + wait > self.deadline_s:
                    reason = error.reason if isinstance(error, HPDCPHFError) else f"{type(error).__name__}: {error}"
                    raise StorageReadError(
                        f"{what} failed {tries} time(s) in {elapsed:.1f} s, giving up (retry policy: "
                        f"{self.attempts} attempts within {self.deadline_s:g} s); last error: {reason}",
                        file=file,
                    ) from error
                time.sleep(wait)
                delay = min(delay * 2, self.max_backoff_s)


class FirstAnswer:
    """Whether a store has answered once, and the rule until it has: a request that gets no answer
    at all (``no_answer`` of its error: refused, timed out, name not resolved) is not retried but
    raises :class:`UnreachableError` naming ``where`` (the endpoint) and ``hint`` (what to set).
    Failures with an answer (5xx, 429, a cut body) are retried under the policy as always, and once
    the store has answered, every transient failure is (a store that was there is worth waiting for)."""

    def __init__(self, no_answer: Callable[[BaseException], bool], where: str, hint: str) -> None:
        self.answered = False
        self.no_answer = no_answer
        self.where = where
        self.hint = hint

    def run(
        self,
        retry: RetryPolicy,
        attempt: Callable[[], T],
        *,
        what: str,
        file: str | None,
        is_transient: Callable[[BaseException], bool],
    ) -> T:
        """``retry.run(attempt, ...)`` under the first-answer rule."""

        def transient(error: BaseException) -> bool:
            return is_transient(error) and (self.answered or not self.no_answer(error))

        try:
            result = retry.run(attempt, what=what, file=file, is_transient=transient)
        except Exception as error:
            cause = error.__cause__ if isinstance(error, StorageReadError) and error.__cause__ else error
            if not self.no_answer(cause):
                self.answered = True  # an answer, if not the one hoped for (404, 403, 5xx)
            elif not self.answered:
                raise self.unreachable(cause, what, file) from error
            raise
        self.answered = True
        return result

    def unreachable(self, error: BaseException, what: str, file: str | None) -> UnreachableError:
        return UnreachableError(
            f"{what} got no answer from {self.where} ({type(error).__name__}: {' '.join(str(error).split())}), "
            f"not retried as it never answered; {self.hint}",
            file=file,
        )


# -- ranged answers -------------------------------------------------------------------------------

CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
"""A ``Content-Range`` value: first byte, last byte, total size (``*`` when the server does not say)."""


def etag(value: str | None) -> str | None:
    """An ETag as compared: a weak one (``W/"x"``) names the same version as the strong ``"x"``."""
    if not value:
        return None
    return value.strip().removeprefix("W/")


def check_answer(
    file: str,
    pos: int,
    end: int,
    status: int,
    content_range: str | None,
    content_length: str | None,
    expected: FileVersion | None,
    tag: str | None,
) -> None:
    """A 200 or 206 answer to a request for bytes ``[pos, end)`` carries exactly those bytes of the
    ``expected`` version (its size and ``tag`` where given), or raise before its body is read."""
    asked = f"bytes [{pos}, {end})"
    m = CONTENT_RANGE.match(content_range or "")
    if expected is not None:
        if status == 206 and m and m.group(3) != "*":
            expected.check(file, size=int(m.group(3)))
        expected.check(file, tag=tag)
    if status == 206:
        if m is None:
            raise StorageReadError(f"{asked}: 206 without a valid Content-Range header", file=file)
        first, last, total = int(m.group(1)), int(m.group(2)), m.group(3)
        if total != "*" and int(total) < end:
            raise StorageReadError(
                f"{asked}: the file has only {total} bytes (it changed since its header was read?)", file=file
            )
        if first != pos or last + 1 < end:
            raise StorageReadError(f"{asked}: the server answered with bytes [{first}, {last + 1}) instead", file=file)
        return
    if pos == 0 and content_length is not None and int(content_length) == end:
        if expected is not None:
            expected.check(file, size=int(content_length))
        return  # the whole file is exactly the range asked
    raise StorageReadError(
        f"{asked}: the server ignored the Range header (HTTP {status} with the whole file"
        f"{f', {content_length} bytes' if content_length is not None else ''}); hp-dcp-hf reads byte ranges "
        "only, serve the checkpoint from a server that honours Range (206 Partial Content)",
        file=file,
    )


Body = Callable[[memoryview], int]
"""``readinto`` of a response body: fills a view, returns how many bytes came (0 at its end)."""


def transferred(error: BaseException, nbytes: int) -> None:
    """Mark ``error``, a read's, with the bytes the read had put into its buffers before it failed
    (``error.transferred``): a reader that wrote into its destinations in place tells a failure
    that left them as they were (0) from one that may have changed them (:func:`placing`)."""
    error.transferred = nbytes  # type: ignore[attr-defined]


@contextlib.contextmanager
def placing(mark: Callable[[], None]) -> Iterator[None]:
    """Run a read into buffers, then ``mark()`` that they may hold its bytes: after it, and after
    its failure unless the error says it placed none (``transferred`` 0; unsaid counts as some)."""
    try:
        yield
    except BaseException as e:
        if getattr(e, "transferred", None) != 0:
            mark()
        raise
    mark()


def read_ranged(
    file: str,
    start: int,
    buffers: Sequence[Any],
    open_range: Callable[[int, int], AbstractContextManager[Body]],
    run: Callable[[Callable[[], None], str], None],
) -> None:
    """Fill ``buffers`` (in order) from the bytes at ``start``, each answer's body read straight into them.

    ``open_range(pos, end)`` sends one request for the bytes ``[pos, end)`` and, once its answer is
    checked, yields the ``readinto`` of its body; ``run(attempt, what)`` runs the tries under a retry
    policy. A try that fails part-way (a dropped connection, a body cut short) resumes after the
    bytes that arrived: no byte is fetched twice and none is copied through a buffer of our own.
    """
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
    end = start + sum(v.nbytes for v in views)
    if end == start:
        return
    progress = [start, 0, 0]  # the next byte, the view it goes to, the offset in that view

    def attempt() -> None:
        pos = progress[0]
        with open_range(pos, end) as readinto:
            while progress[0] < end:
                _, index, offset = progress
                view = views[index]
                n = readinto(view[offset : offset + min(_READ_CHUNK, view.nbytes - offset)])
                if not n:
                    raise TransientError(f"body ended after {progress[0] - pos} of {end - pos} bytes", file=file)
                progress[0] += n
                progress[2] += n
                if progress[2] == view.nbytes:
                    progress[1] += 1
                    progress[2] = 0

    try:
        run(attempt, f"GET bytes [{start}, {end})")
    except HPDCPHFError as e:  # a file gone (404, NoSuchKey) as well as a failed read
        transferred(e, progress[0] - start)
        raise
