"""Making and opening a store's directory and tiers: the builder of the :class:`Engine` that
``TieredStore.create`` and ``TieredStore.open`` (as its writer) wrap, each step in order,
every failure undone."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from pathlib import Path

from tiered_emb import _directory
from tiered_emb._args import snapshot_arg
from tiered_emb._backend import resolve_xp
from tiered_emb.config import TableConfig, TierConfig
from tiered_emb.engine import Engine
from tiered_emb.errors import ConfigError
from tiered_emb.tiers import SsdSettings, SsdTier


def create(path_arg: str | os.PathLike[str], tables_arg: Iterable[TableConfig], tiers: TierConfig, seed: int) -> Engine:
    """The engine of a new store at ``path_arg`` (see ``TieredStore.create``; every argument is checked here)."""
    path = Path(path_arg)
    tables = list(tables_arg)
    if not tables or not all(isinstance(t, TableConfig) for t in tables):
        raise ConfigError(f"tables={tables!r} is invalid", "pass a non-empty list of TableConfig")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ConfigError(f"tables have duplicate names {sorted(names)}", "give every table its own name")
    if not isinstance(tiers, TierConfig):
        raise ConfigError(f"tiers={tiers!r} is invalid", "pass a TierConfig")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64:
        raise ConfigError(f"seed={seed!r} is invalid", "use an int in [0, 2**64)")
    if tiers.keep_checkpoints is None:
        tiers = dataclasses.replace(tiers, keep_checkpoints=1)
    _directory.refuse_existing(path)
    resolve_xp(tiers.device)  # fail on device="cuda" before anything is written
    lock_fd = _directory.make(path)
    ssd = None
    try:
        ssd = _ssd_tier(path, tables, tiers, tiers.map_size_bytes)
        meta = {"format": _directory.FORMAT, "epoch": 0}
        ssd.checkpoint({}, meta, None)
        _directory.fsync_dir(path / "lmdb")  # data.mdb's entry (LMDB syncs the file, not its directory)
        engine = Engine(path, tables, tiers, seed, lock_fd, ssd, meta)
        engine.write_manifest()
    except BaseException:
        if ssd is not None:
            ssd.close()
        _directory.unmake(path, lock_fd)
        raise
    return engine


def open_writer(
    path_arg: str | os.PathLike[str], tiers: TierConfig | None, restore: str, snapshot: int | None
) -> Engine:
    """The engine of the store at ``path_arg``, opened as its writer (see ``TieredStore.open``)."""
    path = Path(path_arg)
    if restore not in ("checkpoint", "latest"):
        raise ConfigError(f"restore={restore!r} is invalid", "use 'checkpoint' or 'latest'")
    snapshot_arg(snapshot, restore)
    manifest, tables, stored_tiers, seed = _directory.read_manifest(path)
    if tiers is not None and not isinstance(tiers, TierConfig):
        raise ConfigError(f"tiers={tiers!r} is invalid", "pass a TierConfig or None")
    _directory.check_data_file(path)
    tiers = tiers or stored_tiers
    if tiers.keep_checkpoints is None:  # (the store's own setting)
        tiers = dataclasses.replace(tiers, keep_checkpoints=stored_tiers.keep_checkpoints or 1)
    lock_fd = _directory.lock(path)
    ssd = None
    try:
        resolve_xp(tiers.device)
        map_size = max(tiers.map_size_bytes, stored_tiers.map_size_bytes)
        ssd = _ssd_tier(path, tables, tiers, map_size, existing=True)
        if snapshot is not None:
            ssd.open_at(snapshot)
        elif restore == "latest":
            ssd.promote_pending()
        else:
            ssd.discard_pending()
        meta = ssd.read_meta()
        engine = Engine(path, tables, tiers, seed, lock_fd, ssd, meta)
        if manifest["format"] != _directory.FORMAT:
            engine.write_manifest()  # before any row is written in this format
    except BaseException:
        if ssd is not None:
            ssd.close()
        os.close(lock_fd)
        raise
    return engine


def _ssd_tier(
    path: Path, tables: list[TableConfig], tiers: TierConfig, map_size: int, existing: bool = False
) -> SsdTier:
    """The SSD tier of the store at ``path`` (its ``tables``, under ``tiers``)."""
    return SsdTier(path / "lmdb", SsdSettings.of(tables, tiers, map_size), existing=existing)


__all__ = ["create", "open_writer"]
