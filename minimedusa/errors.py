"""What the user asked for, gone wrong, and the one way every command line ends on it.

A bad flag value, a missing, empty or malformed file, heads or a tree that do not fit the model,
a prompt too long for the context: each raises a UserError (or a subclass named for the file
that raises it), and every entry point runs under `entry_point`, which prints `error: ...` in
one line and exits with status 1. So does an OSError (a full disk, a folder that cannot be
written: the machine's files, not this code), and a closed standard output (`| head`) ends the
program quietly. Anything else is a bug here and keeps its traceback.
"""
import contextlib
import functools
import os
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
        except OSError as e:
            where = f": {e.filename}" if e.filename else ""
            sys.exit(f"error: {one_line(e.strerror or str(e))}{where}")
    return run


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
