"""ettflow.flows: the Prefect flows (thin: a short list of task calls) and `ettflow refresh`.

- refresh: `refresh_model`, the flow the deployments in prefect.yaml run (its plan type and
  parameter checks are `ettflow.tasks.plan`: imports run flows -> tasks, never back)
- cli: `register(subparsers)` adds `ettflow refresh` (one refresh here, then its ETT report)
"""

import os as _os

# A flow run that a worker started (`PREFECT__FLOW_RUN_ID` in its environment) imports its flow
# from here before anything else of ettflow: the only place to make its console as clean as the
# CLI's (the known third-party noise of `ettflow.console`, by name; `ETTFLOW_VERBOSE=1`, which
# `ettflow up --verbose` gives the worker, shows everything). In any other process the caller
# (the CLI, a test) decides.
if _os.environ.get("PREFECT__FLOW_RUN_ID"):
    from ettflow.console import quiet_third_party as _quiet
    from ettflow.console import verbose_from_env as _verbose

    _quiet(_verbose())
