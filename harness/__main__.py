import sys

from harness.cli.main import run_main

# run_main installs the SIGTERM handler; the dml-harness console script calls it too.
sys.exit(run_main())
