"""The record: what one launch measured (:mod:`.measurement`), the SQLite ledger it is appended to
(:mod:`.ledger`, :mod:`.schema`), the hash chain over its rows (:mod:`.chain`) and the rows kept as
a file with their hashes (:mod:`.rows`).

Nothing is imported here: a worker writes a measurement without loading SQLite."""
