"""Local mode: regions from a directory of YAML files, status on stdout."""
