"""The extraction cache: sharded Zarr v3 stores, a per-sample table, metadata and the target pieces.

The cache owns its directory: `layout.py` is the contract (names, dtypes, the storage conversion, the one hash);
`location.py` creates, checks and claims a cache directory; `target.py` writes target/; `writer.py` is the only
writer of a store; `reader.py`, `store_reader.py` and `verify.py` only read.
"""
