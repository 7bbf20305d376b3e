"""What the user asked for, gone wrong, and the one way every command line ends on it.

A bad flag value, a missing, empty or malformed file, heads or a tree that do not fit the model,
a prompt too long for the context: each raises a UserError (or a subclass named for the file
that raises it), and every entry point runs under `entry_point`, which prints `error: ...` and
exits with status 1. Anything else is a bug here and keeps its traceback.
"""
import contextlib
import functools
import sys


class UserError(Exception):
    """An input the user can fix; the message names the input and the problem."""


def entry_point(main):
    """Wrap a command line's main(): a UserError ends it with one line, not a traceback."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as e:
            sys.exit(f"error: {e}")
        except KeyboardInterrupt:
            sys.exit("\ninterrupted")
    return run


@contextlib.contextmanager
def quiet_interrupt():
    """Ctrl-C inside ends the program in one line, as entry_point ends it later: for an entry
    point's imports (torch takes seconds to load, before main and its guard run)."""
    try:
        yield
    except KeyboardInterrupt:
        sys.exit("\ninterrupted")
