"""Tasks served by the proxy: the record and its rules (`model`), the store protocol and its
diskcache and Redis backends, the task service of one node, and the v1 / v2 wire renderings."""
