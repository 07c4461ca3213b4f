"""nrl plugin package."""
