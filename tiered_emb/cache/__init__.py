"""Caching of one tier: id -> slot index, slot bookkeeping (admit, evict, pin) and policies."""
