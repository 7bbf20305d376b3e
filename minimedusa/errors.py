"""What the user asked for, gone wrong, and the one way every command line ends on it.

A bad flag value, a missing, empty or malformed file, heads or a tree that do not fit the model,
a prompt too long for the context: each raises a UserError (or a subclass named for the file
that raises it), and every entry point runs under `entry_point`, which prints `error: ...` in
one line and exits with status 1. So does an OSError (a full disk, a folder that cannot be
written: the machine's files, not this code) and memory refused (out_of_memory: the line names
the process's address-space limit, which a user can raise), and a closed standard output
(`| head`) ends the program quietly. Anything else is a bug here and keeps its traceback.
"""
import contextlib
import errno
import functools
import os
import resource
import sys


class UserError(Exception):
    """An input the user can fix; the message names the input and the problem."""


def json_kind(value) -> str:
    """What a JSON value is, in JSON's words: for "config.json holds a list, not an object"."""
    kinds = {dict: "an object", list: "a list", str: "a string", bool: "true or false",
             type(None): "null", int: "a number", float: "a number"}
    return kinds.get(type(value), type(value).__name__)


def entry_point(main):
    """Wrap a command line's main(): a UserError ends it with one line, not a traceback."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            sys.exit(f"error: {one_line(str(e))}")
        except KeyboardInterrupt:
            sys.exit("\ninterrupted")
        except BrokenPipeError:  # the reader of standard output left: nothing to say to it
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            sys.exit(1)
        except (MemoryError, RuntimeError, OSError) as e:
            if out_of_memory(e):
                sys.exit(f"error: out of memory ({one_line(str(e)) or 'MemoryError'}): "
                         f"{memory_advice()}")
            if isinstance(e, RuntimeError):
                raise  # a bug here: its traceback
            where = f": {e.filename}" if getattr(e, "filename", None) else ""
            sys.exit(f"error: {one_line(getattr(e, 'strerror', None) or str(e))}{where}")
    return run


def out_of_memory(e: BaseException) -> bool:
    """Whether an exception says the process could not get memory (MemoryError, an OSError of
    ENOMEM, torch's allocator or a file's map refused: "Cannot allocate memory")."""
    return (isinstance(e, MemoryError) or getattr(e, "errno", None) == errno.ENOMEM
            or "Cannot allocate memory" in str(e) or "can't allocate memory" in str(e))


def disk_full(e: BaseException) -> str | None:
    """The cause, where an exception says a write found no room (ENOSPC, EDQUOT, or a
    library's message of them: safetensors' "No space left on device (os error 28)"); else
    None. The file written is then fine: the disk is not."""
    if getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return os.strerror(e.errno)
    for words in ("No space left on device", "Disk quota exceeded"):
        if words in str(e):
            return words
    return None


def memory_advice() -> str:
    """What to do when memory runs out, naming the process's address-space limit if it has one
    (ulimit -v, prlimit --as, a batch scheduler's): that limit, not the file, is then the cause."""
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit == resource.RLIM_INFINITY:
        return "free memory (other programs), or use a smaller weight format (--quantize int4)"
    return (f"this process may reserve at most {limit / 1e9:.1f} GB of address space (ulimit -v, "
            "prlimit --as or the scheduler's limit): raise it, or use a smaller weight format "
            "(--quantize int4)")


def unreadable(path, e: BaseException) -> str:
    """Why a file could not be read, in one line: out of memory (the file is fine) or, for
    anything else a reader raises, a file cut short or damaged."""
    said = one_line(str(e)) or type(e).__name__
    if out_of_memory(e):
        return f"cannot read {path}: out of memory ({said}); the file is not at fault: " \
               f"{memory_advice()}"
    return f"cannot read {path} (truncated or corrupt?): {said}: write or fetch it again"


def one_line(text: str) -> str:
    """A message of several lines (a template's exception, a library's) as one."""
    return " | ".join(line.strip() for line in text.strip().splitlines() if line.strip())


@contextlib.contextmanager
def quiet_interrupt():
    """Ctrl-C inside ends the program in one line, as entry_point ends it later: for an entry
    point's imports (torch takes seconds to load, before main and its guard run)."""
    try:
        yield
    except KeyboardInterrupt:
        sys.exit("\ninterrupted")
