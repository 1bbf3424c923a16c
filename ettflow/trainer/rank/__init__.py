"""The trainer's rank side: what runs in a rank's process (a `TrainerActor`): the session and
its init stages, the rank's state, the training loop, its checkpointing (`checkpointing.py`:
its tiers behind one interface, `tiers.py`, the anchor, restores) and compile cache (`compile_plugin.py`),
evaluation, numerics checks, preemption, a spare's prewarm and the rank's part of a live
recovery. Checkpointing (`trainer/checkpoint/`), the compile cache (`trainer/compile/`),
the model and the data pipeline are shared with the driver side and the publisher."""
