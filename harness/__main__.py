import signal
import sys

from .cli import main


def _terminated(signum, frame):
    # SIGTERM (a sweep stopping its workers, a cluster's time limit) unwinds like Ctrl-C,
    # so the current run is marked KILLED instead of left RUNNING in the tracking store.
    raise KeyboardInterrupt


signal.signal(signal.SIGTERM, _terminated)
sys.exit(main())
