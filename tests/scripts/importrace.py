"""Shared by the rank threads of tests/scripts/self_replacing_in_function.py and
tests/scripts/replacingpkg: when the package's import has begun, and how many other threads
must reach their import statement before it ends."""

import threading

started = threading.Event()
others = 0
