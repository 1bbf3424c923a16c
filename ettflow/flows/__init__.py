"""ettflow.flows: the Prefect flows (thin: a short list of task calls) and `ettflow refresh`.

- params: the refresh's parameters -> `RefreshPlan` (a bad parameter is rejected by name)
- refresh: `refresh_model`, the flow the deployments in prefect.yaml run
- cli: `register(subparsers)` adds `ettflow refresh` (one refresh here, then its ETT report)
"""
