"""Applications built on the public API: the stream job, the DLRM job and its click data."""
