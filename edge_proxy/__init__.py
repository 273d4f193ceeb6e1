"""edge_proxy."""
