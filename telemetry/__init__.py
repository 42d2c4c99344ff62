"""Ground package: the metric catalog every service imports (no service or CLI imports here)."""
