"""What the user asked for, gone wrong: a bad flag value, a missing, empty or malformed file,
heads or a tree that do not fit the model, a prompt too long for the cache. Every entry point
ends on these with one line, `error: ...`, not a traceback: a traceback means a bug here."""
import functools
import sys

from minimedusa.default_model import DefaultModelError
from minimedusa.heads import HeadsError
from minimedusa.kv_cache import CacheOverflowError
from minimedusa.model import ConfigError
from minimedusa.plain_decoding import PromptTooLongError
from minimedusa.training import DataError
from minimedusa.tree import TreeError
from minimedusa.weights import WeightsError

# ValueError itself too: the device, dtype, sampling and chat-template checks raise it
USER_ERRORS = (ConfigError, WeightsError, HeadsError, TreeError, DataError, PromptTooLongError,
               CacheOverflowError, DefaultModelError, FileNotFoundError, ValueError)


def one_line_errors(main):
    """Wrap an entry point's main(): a user error exits with `error: ...` (status 1)."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except USER_ERRORS as e:
            sys.exit(f"error: {e}")
    return run
