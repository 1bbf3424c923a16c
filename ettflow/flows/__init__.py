"""ettflow.flows: the Prefect flows (thin: a short list of task calls) and `ettflow refresh`.

- refresh: `refresh_model`, the flow the deployments in prefect.yaml run (its plan type and
  parameter checks are `ettflow.tasks.plan`: imports run flows -> tasks, never back)
- cli: `register(subparsers)` adds `ettflow refresh` (one refresh here, then its ETT report)
"""
