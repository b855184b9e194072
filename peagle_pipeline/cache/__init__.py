"""The extraction cache: sharded Zarr v3 stores, a per-sample table, metadata and the target pieces.

`layout.py` is the contract; `writer.py` is the only writer; `reader.py` only reads.
"""
