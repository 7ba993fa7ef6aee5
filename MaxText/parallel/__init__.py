"""Device mesh, logical-axis sharding, and multi-process start-up."""
