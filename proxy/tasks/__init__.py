"""Tasks served by the proxy: the status machine (model), the disk-backed store, the tasks/* service."""
