"""The results store: every benchmark run with its configuration, commit, machine, measurements and device samples.

SQLite by default, PostgreSQL for a team; one schema (schema.py) for both. See docs/benchmark-history.md.
"""

from service.bench.store.errors import StoreError
from service.bench.store.store import Run, Store, add_db_argument, default_url, open_store, open_store_or_exit

__all__ = ["Run", "Store", "StoreError", "add_db_argument", "default_url", "open_store", "open_store_or_exit"]
