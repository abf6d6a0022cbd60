"""Storage backends behind one small async interface. Knows nothing about checkpoints."""

from transfer.store.base import ObjectInfo, Store, Upload
from transfer.store.url import StoreOptions, open_store

__all__ = ["ObjectInfo", "Store", "StoreOptions", "Upload", "open_store"]
