"""One training step, stage by stage, in the order a batch goes through them.

``plan`` (dedupe) -> ``resolve`` (the tiers walked: HBM probe, misses up from DDR / LMDB /
the initialiser, victims down) -> ``gather`` (rows or pooled bags out of HBM slots);
backward: ``reduce`` (gradients per unique id, in batch order) -> ``update`` (the
optimizer on the slots).  :class:`tiered_emb.TieredStore` calls them; each module is
readable on its own.
"""
