"""The trainer's driver side: what runs in the process that drives a run (the Prefect flow's,
or the bench's): the training driver and its failure policy, the Ray worker group and its
placement, the warm pool and the run's spares, the restore point a live recovery resumes
from, and the spool tail the driver watches. It talks to the ranks only through the Ray
actor's calls and the values of `trainer/protocol.py`."""
