"""Signal handling shared by the benchmarks that start subprocesses."""

from __future__ import annotations

import signal
import sys


def exit_on_sigterm(signum: int, frame: object) -> None:
    """Unwinds like Ctrl-C, so ``finally`` stops the subprocesses.

    Later SIGTERMs are ignored so they cannot cut the clean-up short (coreutils ``timeout``
    signals the process and then its process group).
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(128 + signum)
