"""Cache-policy simulation: traces, policies, miss-ratio curves (standalone, no trainer)."""
from .traces import zipf_ids

__all__ = ["zipf_ids"]
