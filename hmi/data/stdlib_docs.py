"""Docstrings of the Python standard library, read from the running interpreter.

Run as a module in a child process (``python -m hmi.data.stdlib_docs``) so that importing
hundreds of modules never touches the caller; prints one JSON string per line.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import re
import sys

# Modules with side effects on import (a browser, a window, printing) or none worth reading.
SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "__main__", "pydoc_data",
        "lib2to3", "ensurepip", "venv", "test", "msilib", "winreg", "winsound", "_msi", "nt", "msvcrt"}


def docstrings() -> list[str]:
    seen, out = set(), []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP:
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                mod = importlib.import_module(name)
        except Exception:
            continue
        objs = [mod] + [v for _, v in sorted(vars(mod).items()) if inspect.isclass(v) or inspect.isfunction(v)]
        for obj in objs:
            members = [obj] + ([v for _, v in sorted(vars(obj).items()) if inspect.isfunction(v)]
                               if inspect.isclass(obj) else [])
            for m in members:
                doc = inspect.getdoc(m)
                if not doc or getattr(m, "__module__", name) not in (name, None) and m is not mod:
                    continue
                for para in re.split(r"\n\s*\n", doc):
                    para = re.sub(r"\s+", " ", para).strip()
                    if len(para) >= 40 and para not in seen:
                        seen.add(para)
                        out.append(para)
    return out


if __name__ == "__main__":
    for d in docstrings():
        sys.stdout.write(json.dumps(d) + "\n")
