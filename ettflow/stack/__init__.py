"""The deployed path on one machine: `ettflow up`, `ettflow down`, `ettflow status`.

`up` starts (or finds already running) what a deployed refresh needs: a Prefect server, a Ray
head that every flow run joins (so no run starts a Ray of its own on its clock), the process
work pool, the deployments of `prefect.yaml`, a process worker with flow-run heartbeats, the
crash (zombie) automation and the shipped alert automations. Its records (each process it
started, the ports, the logs) live under `$ETTFLOW_HOME/stack/`; `down` stops what `up`
started, by those records and by the stack's id, which every process it starts (and every
process they start) carries in its environment. `--refreshes N` then runs N refreshes as
deployment runs that the worker executes, and compares them.

Modules: `config` (the validated settings), `records` (what `up` started, on disk, and the
processes of a stack), `services` (each service: start or find, wait until it answers),
`lifecycle` (up, down, status), `deployed_runs` (deployment runs and their wait), `cli`.
"""
