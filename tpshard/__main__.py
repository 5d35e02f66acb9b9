import os
import signal
import sys

# Ctrl-C while the command's modules load is held until they are loaded: a KeyboardInterrupt raised
# inside a C extension's initialisation (msgspec's) can crash the interpreter (SIGSEGV).
_held = []
signal.signal(signal.SIGINT, lambda *_: _held.append(True))
from tpshard.cli import main  # noqa: E402

signal.signal(signal.SIGINT, signal.default_int_handler)
if _held:
    sys.stderr.write("interrupted: stopped before anything was done\n")
    sys.stderr.flush()
    os._exit(130)
main()
