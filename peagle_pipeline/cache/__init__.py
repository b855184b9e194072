"""The extraction cache: sharded Zarr v3 stores, a per-sample table, metadata and the target pieces.

The cache owns its directory: `layout.py` is the contract (names, dtypes, the storage conversion, the one hash);
`location.py` creates, checks and claims a cache directory; `target.py` writes target/; `writer.py` is the only
writer of a store, writing its arrays with `store_arrays.py` and committing its tables and manifest with `commit.py`
(`remote.py` mirrors it to an object store); `reader.py`, `store_reader.py` and `verify.py` only
read, decoding a stored array's bytes with `shard_format.py` and fetching an object store's byte ranges with
`object_ranges.py`.
"""
