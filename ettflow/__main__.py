"""`python -m ettflow`: the `ettflow` command; in the worker process of `ettflow refresh`
(`flows.supervise` starts it with the command's argv in its environment) the supervised work."""

import os
import sys

from ettflow.cli import main
from ettflow.flows.supervise import ARGV_ENV, worker_main

if __name__ == "__main__":
    sys.exit(worker_main(main) if ARGV_ENV in os.environ else main(sys.argv[1:]))
