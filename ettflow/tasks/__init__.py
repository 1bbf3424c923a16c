"""ettflow.tasks: the refresh's Prefect tasks and state hooks.

- trainer: reserve_trainer -> train -> anchor_checkpoint -> release_trainer (lease: the held group)
- publish: the publish task (a thin call to `ettflow.publish.publish_snapshot`, retried)
- archive: hooks that archive the run's ETT from its spool, idempotently, then the artifacts
- artifacts, timeline_plot, progress: what the Prefect UI shows; run_spool: the tasks' own events
"""
