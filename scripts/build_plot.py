#!/usr/bin/env python
"""Offline PLOT building: the same as `hmi plot build` (see `--help`)."""

import sys

from hmi.cli import main

if __name__ == "__main__":
    sys.exit(main(["plot", "build", *sys.argv[1:]]))
