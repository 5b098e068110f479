"""pagedserve control plane: REST, scheduling, block bookkeeping (CPU only, no torch)."""
__version__ = "0.1.0"
