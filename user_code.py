"""user_code.py: code the user names by flag (rewards, tools, environments: `package.module:function`), imported
with one clear error and a bounded import time, and called within a deadline (every call in its own thread, sync or
async) so that a hang or a raise is contained and reported, never a hung run.
"""
import asyncio
import importlib
import inspect
import threading
import time


def resolve(name, flag, timeout_s=0):
    """'pkg.module:function' -> the object, its module imported within timeout_s (0 = no limit; a module that hangs at
    import would hang every rank), or one clear error naming the flag. Anything else the module raises while it runs
    is a bug in it: re-raised with its traceback."""
    module, _, attr = name.partition(":")
    if not (module and attr):
        raise ValueError(f"{flag} {name!r}: pass package.module:function (a module path, a colon, the name in it).")
    hangs = ValueError(f"{flag} {name!r}: importing module {module!r} did not finish within {timeout_s:g} s "
                       "(--data.import-timeout-s): it hangs at import (a loop, a lock or a network call at module "
                       "level?). Fix the module, or raise the limit if its import is just slow.")
    try:
        mod = within(lambda: importlib.import_module(module), timeout_s, hangs)
    except ModuleNotFoundError as e:
        if not (e.name and (module + ".").startswith(e.name + ".")):  # a module it imports is missing
            raise ValueError(f"{flag} {name!r}: module {module!r} imports {e.name!r}, which is not installed. Install "
                             "it or drop that import.") from None
        raise ValueError(f"{flag} {name!r}: no module {module!r} can be imported. It must be importable: put it in the "
                         "repo root (next to grpo.py) or on PYTHONPATH, and name it package.module:function.") from None
    except ImportError as e:
        raise ValueError(f"{flag} {name!r}: importing module {module!r} failed ({e}).") from None
    if not hasattr(mod, attr):
        raise ValueError(f"{flag} {name!r}: module {module!r} ({getattr(mod, '__file__', '?')}) has no {attr!r}. "
                         "Name a function (or class) defined in it.")
    return getattr(mod, attr)


class TimedOut(Exception):
    """A tool or environment call still running at its deadline."""


def call_all(thunks, timeout_s):
    """Run every thunk at once, each in its own daemon thread, all within `timeout_s` -> [(value, error, seconds)]:
    error is None, what the thunk raised (any BaseException: a SystemExit in a thread would otherwise vanish and read as
    a timeout), or TimedOut. A thunk still running at the deadline is left to run, unwaited (Python cannot stop it)."""
    t0, results = time.time(), [None] * len(thunks)

    def work(i, thunk):
        try:
            results[i] = (thunk(), None, time.time() - t0)
        except BaseException as e:  # noqa: BLE001 - user code: reported, never raised here
            results[i] = (None, e, time.time() - t0)
    threads = [threading.Thread(target=work, args=(i, f), daemon=True) for i, f in enumerate(thunks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, t0 + timeout_s - time.time()))
    late = (None, TimedOut(f"timed out after {timeout_s:g} s"), timeout_s)
    return [r or late for r in list(results)]  # a copy: a call that finishes later writes into the old list only


def within(call, timeout_s, late):
    """call() on a daemon thread (call_all), waited for at most timeout_s (0 = no limit) -> its result, or its
    exception; the exception `late` past the deadline. (Python cannot stop a thread: a late call is left to finish.)"""
    if not timeout_s:
        return call()
    out, error, _ = call_all([call], timeout_s)[0]
    if error is not None:
        raise late if isinstance(error, TimedOut) else error
    return out


def call_bounded(fn, args, timeout_s):
    """fn(**args); an async function is awaited and cancelled at timeout_s (TimedOut)."""
    out = fn(**args)
    if inspect.isawaitable(out):  # an async tool: cancelled at the timeout
        try:
            out = asyncio.run(asyncio.wait_for(out, timeout_s))
        except asyncio.TimeoutError:
            raise TimedOut(f"timed out after {timeout_s:g} s") from None
    return out
