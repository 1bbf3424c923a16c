"""ettflow: Effective Training Time for continuous TorchRec refreshes."""
__version__ = "0.1.0"
