"""`python failed_restore_reports.py WORKDIR`: resumes WORKDIR (a copy of
test_checkpoint's run whose newest checkpoint is damaged) through the library
in a fresh process, with a user's own hooks and log handler in place, and
prints as JSON the error and what reached the hooks and the handler.

A failed read leaves orbax's other reads running: their callbacks into the
closed event loop, and their coroutines and tasks collected unfinished, should
reach nothing; anyone else's reports after it still should. A fresh process,
because the leftovers of a failed restore earlier in the same process arrive
whenever they finish, under whichever hooks are in place by then.
"""

import gc
import json
import logging
import sys
import types

from test_checkpoint import run_config
from test_error_causes import _collected_unretrieved

from meshtrain.errors import ConfigError
from meshtrain.train.loop import train


def _unraisable(obj, error: Exception) -> None:
  sys.unraisablehook(types.SimpleNamespace(exc_type=type(error), exc_value=error,
                                           exc_traceback=error.__traceback__, err_msg=None,
                                           object=obj))


def main(workdir: str) -> None:
  from orbax.checkpoint._src.serialization import serialization
  reported, logged = [], []
  sys.unraisablehook = lambda unraisable: reported.append(str(unraisable.exc_value))
  sys.excepthook = lambda kind, value, tb: reported.append(str(value))
  handler = logging.Handler(logging.WARNING)
  handler.emit = lambda record: logged.append(record.getMessage().splitlines()[0])
  logging.getLogger().addHandler(handler)
  try:
    train(run_config(workdir))
    error = None
  except ConfigError as raised:
    error = str(raised)
  read = serialization._read_array_index_and_device_put
  code = read.__code__  # a coroutine of orbax, collected unfinished
  leftover = read(*[None] * code.co_argcount, **dict.fromkeys(
      code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount]))
  _unraisable(leftover, RuntimeError("coroutine ignored GeneratorExit"))
  leftover.close()
  _unraisable((lambda: (yield))(), ValueError("not orbax's"))
  _collected_unretrieved(ValueError("not a read's"))
  gc.collect()
  print(json.dumps({"error": error, "reported": reported, "logged": logged}))


if __name__ == "__main__":
  main(sys.argv[1])
