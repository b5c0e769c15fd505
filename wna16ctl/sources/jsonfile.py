"""JSON parsing with the limits every input file gets: bounded nesting, no NaN/Infinity.

Python's parser raises RecursionError on deep nesting and ValueError on integers of more than
4300 digits; both become one `JSONError` here, so callers turn any malformed file into one line.
"""

from __future__ import annotations

import json
from typing import Any

class JSONError(ValueError):
    pass


def _no_constant(name: str) -> Any:
    raise JSONError(f"{name} is not valid JSON")


def loads(data: bytes | str) -> Any:
    """`json.loads` that raises only JSONError (with a short reason) on malformed input.

    Nesting is bounded by the interpreter's recursion limit (the C parser checks it per level).
    """
    try:
        return json.loads(data, parse_constant=_no_constant)
    except JSONError:
        raise
    except RecursionError:
        raise JSONError("nested too deeply") from None
    except UnicodeDecodeError as e:
        raise JSONError(f"not UTF-8 ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise JSONError(f"line {e.lineno} column {e.colno}: {e.msg}") from None
    except ValueError as e:  # e.g. an integer with more digits than int() accepts
        raise JSONError(str(e).split(";")[0]) from None
