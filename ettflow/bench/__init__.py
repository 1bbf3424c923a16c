"""ettflow bench: the study's paired evaluation on this machine."""
