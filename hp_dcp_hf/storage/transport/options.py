"""Storage options checked before any request: a misspelled key is refused naming the valid ones.

fsspec filesystems take ``**kwargs`` and pass what they do not know further down (s3fs hands it
to aiobotocore's session, fsspec's base class drops it), so a typo fails late and cryptically
(``AioSession._create_client() got an unexpected keyword argument 'endpoint'``) or not at all (a
local path ignores every option). Here the valid keys of each store are read from the signatures
of the classes that take them, so they follow the installed versions:

* **S3** (s3fs): ``S3FileSystem``'s parameters, the botocore session's (where s3fs sends the rest),
  fsspec's instance and listings cache switches; ``client_kwargs``: botocore
  ``Session.create_client``'s; ``config_kwargs``: botocore ``Config``'s options;
* **HTTP(S)**: :data:`~hp_dcp_hf.storage.transport.http_backend.HTTP_OPTIONS`;
* **Hugging Face Hub**: ``HfFileSystem``'s parameters, ``revision``, fsspec's cache switches;
* **local files**: ``LocalFileSystem``'s parameters and fsspec's cache switches.

Other fsspec stores (``gs://``, ``memory://``, ...) are checked where their class takes no
``**kwargs``, else left to the store.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

from hp_dcp_hf.errors import ArgumentError

_SKIP_INSTANCE_CACHE = "skip_instance_cache"
"""Taken by fsspec's instance cache (its metaclass), not by any ``__init__``."""


def parameters(*callables: Callable[..., Any], drop: Collection[str] = ("self",)) -> set[str]:
    """The keyword parameters of ``callables`` (``*args`` / ``**kwargs`` and ``drop`` left out)."""
    names: set[str] = set()
    for fn in callables:
        for name, param in inspect.signature(fn).parameters.items():
            if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY) and name not in drop:
                names.add(name)
    return names


def _takes_any_keyword(fn: Callable[..., Any]) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())


def fsspec_cache_options() -> set[str]:
    """What every fsspec filesystem takes besides its own parameters: the listings cache
    (``DirCache``'s) and ``skip_instance_cache``."""
    from fsspec.dircache import DirCache

    return parameters(DirCache.__init__) | {_SKIP_INSTANCE_CACHE}


def _s3_keys() -> tuple[set[str], dict[str, set[str]]]:
    """s3fs's top-level keys and the keys of its nested ``client_kwargs`` / ``config_kwargs``."""
    import aiobotocore.session
    import botocore.config
    import botocore.session
    from s3fs import S3FileSystem

    top = parameters(S3FileSystem.__init__) | parameters(aiobotocore.session.AioSession.__init__)
    nested = {
        "client_kwargs": parameters(botocore.session.Session.create_client, drop=("self", "service_name", "config")),
        # botocore's Config: our data client builds one from them (aiobotocore's AioConfig takes these too)
        "config_kwargs": set(botocore.config.Config.OPTION_DEFAULTS),
    }
    return top | fsspec_cache_options(), nested


def _hub_keys() -> set[str]:
    from huggingface_hub import HfFileSystem

    return parameters(HfFileSystem.__init__) | {"revision"} | fsspec_cache_options()


def _refuse(store: str, where: str, unknown: Iterable[str], valid: Collection[str], path: str | None) -> ArgumentError:
    unknown = sorted(unknown)
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
        if close:
            hints.append(f"{where + close[0]!r} for {where + key!r}")
    s = "s" if len(unknown) > 1 else ""
    return ArgumentError(
        f"unknown storage option{s} {', '.join(repr(where + k) for k in unknown)} for {store}"
        + (f" (did you mean {', '.join(hints)}?)" if hints else "")
        + f"; valid{' ' + where.rstrip('.') + ' keys' if where else ''}: {', '.join(sorted(valid))}",
        file=path,
    )


def _check(store: str, options: Mapping[str, Any], valid: Collection[str], path: str | None, where: str = "") -> None:
    unknown = set(options) - set(valid)
    if unknown:
        raise _refuse(store, where, unknown, valid, path)


HTTP_OPTIONS = ("headers", "verify", "cert", "proxies")
"""The storage options of http(s) checkpoints: request headers, and the ``requests.Session`` settings."""


def check_storage_options(path: str | None, options: Mapping[str, Any], kind: str, fs_class: type | None = None) -> None:
    """Raise :class:`ArgumentError` naming the valid keys when ``options`` has a key the store of
    ``path`` does not take. ``kind``: ``"http"``, ``"hub"``, ``"s3"``, ``"local"`` or ``"fsspec"``
    (``fs_class`` the filesystem class)."""
    if not options:
        return
    if kind == "http":
        _check("http(s) checkpoints", options, HTTP_OPTIONS, path)
    elif kind == "hub":
        _check("Hugging Face Hub checkpoints (HfFileSystem)", options, _hub_keys(), path)
    elif kind == "s3":
        top, nested = _s3_keys()
        _check("s3:// (s3fs S3FileSystem)", options, top, path)
        for name, valid in nested.items():
            value = options.get(name)
            if value is not None and not isinstance(value, Mapping):
                raise ArgumentError(f"storage option {name!r} must be an object of keys, not {value!r}", file=path)
            _check("s3:// (s3fs S3FileSystem)", value or {}, valid, path, where=f"{name}.")
    elif kind == "local":
        from fsspec.implementations.local import LocalFileSystem

        _check("local files", options, parameters(LocalFileSystem.__init__) | fsspec_cache_options(), path)
    elif fs_class is not None and not _takes_any_keyword(fs_class.__init__):
        _check(f"{fs_class.__name__}", options, parameters(fs_class.__init__) | fsspec_cache_options(), path)
